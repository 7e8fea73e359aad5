"""Worker entry point for function targets: unpickle the call, run it, pickle the result.

Usage (done by the launcher): python -m tf_distrib.launch.run_function CALL RESULT
"""

import os
import pickle
import sys


def main(call_path: str, result_path: str) -> None:
    with open(call_path, "rb") as f:
        parent_path, blob = pickle.load(f)
    sys.path[:0] = [p for p in parent_path if p not in sys.path]
    import cloudpickle

    fn, args, kwargs = cloudpickle.loads(blob)
    value = fn(*args, **kwargs)
    tmp = f"{result_path}.tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(value, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tf_distrib.launch.run_function CALL RESULT")
    main(sys.argv[1], sys.argv[2])
