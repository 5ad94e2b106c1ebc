"""`minipic run-batch`: an offline job over a JSONL file in the OpenAI batch format.

    reading.py   lines -> validated requests or per-line errors (streaming)
    records.py   results and errors -> output records (vLLM run-batch's shape)
    resume.py    which requests an output file already holds; appending safely after a kill
    run_batch.py the job: feed the engine, write results as they finish, progress and summary
"""
