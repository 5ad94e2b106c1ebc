"""The ttft-host bench draws its span ids below every special id (benchmarks/ttft_host.py): a drawn
pad id would be an invisible token, a drawn SSEP/PDEP a primitive in the middle of a span."""

from types import SimpleNamespace

from benchmarks.ttft_host import id_ceiling


def test_ids_stay_below_the_markers_and_eos():
    engine = SimpleNamespace(vocab_size=128256, eos_ids={128009, 128001},
                             markers={"pad_token_id": 128004, "ssep_token_id": 128002,
                                      "pdep_token_id": None})
    assert id_ceiling(engine) == 128001


def test_without_specials_the_vocabulary_bounds_them():
    engine = SimpleNamespace(vocab_size=500, eos_ids=set(), markers={"pad_token_id": None})
    assert id_ceiling(engine) == 490
