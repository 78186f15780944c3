"""ONNX's backend node tests for the operators leafpy's layers cover, run on a leafpy backend:
``python -m leafpy.onnx.conformance --table`` prints the passes per operator beside the total (and onnxruntime's,
where it is installed); ``--exclusions`` prints each failing test with its reason (the error leafpy gives), the
form of tests/onnx_exclusions.txt.

A node test is one small model of one node, with inputs and expected outputs; in them weights arrive as run-time
inputs. Outputs are compared as ONNX's runner compares them (dtype equal, rtol and atol of the test case).
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from collections import Counter
from typing import Any

import numpy as np

OPERATORS = (
    "Conv", "ConvTranspose", "Gemm", "MatMul", "MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool",
    "BatchNormalization", "Relu", "Sigmoid", "Tanh", "LeakyRelu", "Elu", "Gelu", "Softplus", "Softmax", "LogSoftmax",
    "Reshape", "Flatten", "Dropout", "Identity", "Sum", "Add", "Mul", "Max", "Concat", "Split", "Slice", "LRN",
    "Gather", "LSTM", "GRU", "RNN", "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss",
)
"""The operators whose node tests are in scope: those that match leafpy's layers (issue 32's list)."""


@functools.cache
def node_tests() -> list[Any]:
    """ONNX's node test cases whose single node is an operator in scope, in ONNX's order (loaded once)."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    return [c for c in cases if c.model is not None and len(c.model.graph.node) == 1
            and c.model.graph.node[0].op_type in OPERATORS]


def operator_of(case: Any) -> str:
    return case.model.graph.node[0].op_type


def run_case(backend: Any, case: Any, device: str = "CPU") -> str | None:
    """None where ``case`` passes on ``backend`` (an onnx.backend.base.Backend), else why not."""
    try:
        rep = backend.prepare(case.model, device)
        for inputs, expected in case.data_sets:
            outputs = list(rep.run(inputs))
            if len(outputs) != len(expected):
                return f"{len(outputs)} outputs where {len(expected)} are expected"
            for got, want in zip(outputs, expected):
                got = np.asarray(got)
                if got.dtype != want.dtype:
                    return f"output dtype {got.dtype}, expected {want.dtype}"
                np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol)
    except AssertionError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return "outputs differ: " + (lines[1].strip() if len(lines) > 1 else "values")
    except Exception as e:  # a test outcome to report, whatever the backend raised
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def run(backend_name: str = "native") -> dict[str, str | None]:
    """test name -> None (passed) or the reason it fails, on leafpy's ``backend_name``."""
    from .backend import for_backend

    backend = for_backend(backend_name)
    return {c.name: run_case(backend, c) for c in node_tests()}


def onnxruntime_results() -> dict[str, str | None] | None:
    """The same on onnxruntime's backend, or None where onnxruntime is not installed."""
    try:
        import onnxruntime.backend as ort_backend
    except ImportError:
        return None
    return {c.name: run_case(ort_backend, c) for c in node_tests()}


def table(results: dict[str, str | None], reference: dict[str, str | None] | None = None,
          backend_name: str = "native") -> str:
    cases = node_tests()
    total: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    theirs: Counter[str] = Counter()
    for c in cases:
        op = operator_of(c)
        total[op] += 1
        ours[op] += results.get(c.name, "not run") is None
        if reference is not None:
            theirs[op] += reference.get(c.name, "not run") is None
    head = f"| operator | leafpy {backend_name} |" + (" onnxruntime |" if reference is not None else "") + " tests |"
    rows = [head, "|---" * (head.count("|") - 1) + "|"]
    for op in sorted(total):
        rows.append(f"| {op} | {ours[op]} |" + (f" {theirs[op]} |" if reference is not None else "") +
                    f" {total[op]} |")
    rows.append(f"| **all** | **{sum(ours.values())}** |" +
                (f" **{sum(theirs.values())}** |" if reference is not None else "") + f" **{sum(total.values())}** |")
    return "\n".join(rows)


def exclusions(results: dict[str, str | None]) -> str:
    """Each failing test with its reason, one a line: ``test_name  # reason``."""
    return "\n".join(f"{name}  # {reason.split('; leafpy imports:')[0]}" for name, reason in results.items()
                     if reason is not None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leafpy.onnx.conformance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="native", help="the leafpy backend: native, cuda or webgpu")
    ap.add_argument("--table", action="store_true", help="passes per operator beside the total (the default)")
    ap.add_argument("--exclusions", action="store_true", help="print each failing test and its reason")
    ap.add_argument("--no-onnxruntime", action="store_true", help="leave onnxruntime's column out")
    args = ap.parse_args(argv)
    results = run(args.backend)
    if args.exclusions:
        print(exclusions(results))
        return 0
    reference = None if args.no_onnxruntime else onnxruntime_results()
    print(table(results, reference, args.backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
