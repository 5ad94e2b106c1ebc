"""`minipic run-batch`: an offline job over a JSONL file in the OpenAI batch format.

    options.py   the command line: options, number and path checks (before the model is built)
    reading.py   lines -> validated requests or per-line errors (streaming)
    records.py   results and errors -> output records (vLLM run-batch's shape)
    resume.py    which requests an output file already holds; appending safely after a kill
    progress.py  the progress bar, and what it says while step variants compile
    run_batch.py the job: feed the engine, write results as they finish, Ctrl-C, the summary
"""
