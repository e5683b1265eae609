from pstrain.protos.codegen import stale_files


def test_committed_generated_code_matches_the_proto():
    assert stale_files() == [], "run `python -m protos.codegen` (or `make proto`) and commit the result"
