"""benchmarks/query_bench.py --ops times the queries op by op from a copy of their sequence;
the copy must stay the fused node's exact computation (nlq/model/query.py)."""

import importlib.util
from pathlib import Path

import pytest

# query_bench puts the repository and benchmarks/ on sys.path itself (it imports train_bench)
spec = importlib.util.spec_from_file_location(
    "query_bench", Path(__file__).parents[1] / "benchmarks" / "query_bench.py")
query_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(query_bench)


@pytest.mark.parametrize("variant", ["linear", "nonlinear"])
def test_op_sequence_is_the_module_bitwise(variant):
    _, _, call, (q, x, dq) = query_bench.build("preset", variant)
    assert query_bench.op_sequence_matches(variant, call, q, x, dq)


def test_op_sequence_notices_a_different_computation():
    _, _, call, (q, x, dq) = query_bench.build("preset", "nonlinear")
    q.act.approximate = "tanh"  # the node now runs tanh-GELU; the copy still runs exact GELU
    assert not query_bench.op_sequence_matches("nonlinear", call, q, x, dq)
