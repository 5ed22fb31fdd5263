"""benchmarks/query_bench.py --ops times the queries op by op from a copy of their sequence;
the copy must stay the fused node's exact computation (nlq/model/query.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def query_bench():
    sys.path.insert(0, str(BENCH))  # query_bench imports train_bench as a sibling
    try:
        spec = importlib.util.spec_from_file_location("query_bench", BENCH / "query_bench.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("variant", ["linear", "nonlinear"])
def test_op_sequence_is_the_module_bitwise(query_bench, variant):
    _, _, call, (q, x, dq) = query_bench.build("preset", variant)
    assert query_bench.op_sequence_matches(variant, call, q, x, dq)


def test_op_sequence_notices_a_different_computation(query_bench):
    _, _, call, (q, x, dq) = query_bench.build("preset", "nonlinear")
    q.act.approximate = "tanh"  # the node now runs tanh-GELU; the copy still runs exact GELU
    assert not query_bench.op_sequence_matches("nonlinear", call, q, x, dq)
