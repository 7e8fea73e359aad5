"""The benchmark runner's own plumbing (the benchmarks themselves run with `make bench`)."""

import pytest

from tf_distrib.bench import run_in_fresh_process


def test_a_failed_benchmark_process_says_why():
    with pytest.raises(RuntimeError, match=r"(?s)tf_distrib\.no_such_bench failed with exit "
                                           r"status 1:.*No module named"):
        run_in_fresh_process("tf_distrib.no_such_bench")
