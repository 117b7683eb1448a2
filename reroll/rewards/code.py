"""Code reward: run the candidate program against test cases in the sandbox.

Test cases travel in ``RewardSample.answer`` as JSON, in any of these shapes:

- APPS / TACO: ``{"inputs": [...], "outputs": [...]}`` (stdin/stdout), or with ``"fn_name"``
  (function call: each input is the list of arguments, each output the expected return value,
  possibly wrapped in a one-element list as APPS does).
- LiveCodeBench: ``[{"input": ..., "output": ..., "testtype": "stdin" | "functional"}, ...]``,
  or ``{"tests": [...], "fn_name": ...}``. A functional input holds one JSON value per line (the
  arguments), its output one JSON value. The function name may also come from
  ``metadata["fn_name"]`` / ``metadata["func_name"]``. LeetCode-style ``class Solution`` works.
- HumanEval: ``{"test": "def check(candidate): ...", "entry_point": "f"}`` (one test).
- MBPP: ``{"asserts": ["assert f(1) == 2", ...], "setup": "import math"}`` (one test per assert).

Every test runs in its own fresh sandbox with a wall-clock and CPU limit of ``time_limit_s``
(``metadata["time_limit_s"]`` overrides it per sample). Expected outputs of stdio and call tests
never enter the sandbox: results are compared on the host.

A pass is never read from the exit code alone, which the program controls (``sys.exit(0)``,
``os._exit(0)``, an ``atexit`` hook): the harness reads a fresh random nonce from stdin before the
program runs, and writes it only after the test code (HumanEval/MBPP) or the call returned. Test
code arrives on stdin too, never as a file the program could read or rewrite, and runs with the
builtins and common stdlib modules as they were before the program. What is left: code in the
same interpreter can in principle dig the nonce out of the harness's frames, and a returned object
whose ``__eq__`` always says yes passes an ``==`` assert; neither is a mere exit. Credit is all-or-nothing (1.0 only if every test passes; stops
at the first failure) or fractional (passed / total).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reroll.rewards.base import RewardResult, RewardSample
from reroll.sandbox import ExecResult, Limits, Sandbox, SandboxError, parse_size

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}
_DETAIL_CHARS = 300

# Runs inside the sandbox before any code of the candidate. `_take_stdin` reads what the host sent
# (a fresh random nonce per test, then the test's payload) and leaves stdin empty, so the program
# can read neither; the verdict goes to a private duplicate of stdout; the builtins and common
# stdlib modules are restored after the program's top level, so what it patched does not reach
# the tests. Everything lives in function locals: `import __main__` shows the program nothing.
_PRELUDE = """\
import builtins, os, sys
import bisect, cmath, collections, functools, heapq, itertools, math, operator, re, string


def _take_stdin():
    data = b""
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        data += chunk
    r, w = os.pipe()
    os.close(w)
    os.dup2(r, 0)
    os.close(r)
    nonce, _, payload = data.decode().partition("\\n")
    return nonce, payload, os.dup(1)


def _snapshot():
    modules = (builtins, bisect, cmath, collections, functools, heapq, itertools, math, operator,
               re, string)
    return dict(vars(builtins)), dict(sys.modules), [(m, dict(vars(m))) for m in modules]


def _run_program(namespace, snapshot, exec=exec, compile=compile, open=open, exit=os._exit):
    \"\"\"Run solution.py in `namespace`; an exit there fails the test. Then undo what it did to
    the interpreter's modules.\"\"\"
    try:
        exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
    except SystemExit as e:
        sys.stderr.write("the program exited (SystemExit %r) before its tests ran\\n" % (e.code,))
        exit(1)
    sys.settrace(None)
    sys.setprofile(None)
    _, modules, saved = snapshot
    sys.modules.update(modules)
    for module, state in saved:
        vars(module).update(state)


def _exited(e, exit=os._exit):
    sys.stderr.write("the program exited (SystemExit %r) during its tests\\n" % (e.code,))
    exit(1)
"""

# HumanEval / MBPP tests: the test code (stdin's payload, never a file the program could read or
# change) runs after the program, with the builtins of before the program; the nonce is written
# only once it returned — an exit, os._exit or atexit hook of the program leaves no verdict.
_PROGRAM_HARNESS = _PRELUDE + """\


def _main(exec=exec, compile=compile, write=os.write, exit=os._exit):
    nonce, tests, verdict = _take_stdin()
    snapshot = _snapshot()
    scope = {"__name__": "__main__", "__file__": "solution.py", "__builtins__": builtins}
    _run_program(scope, snapshot)
    scope = dict(scope, __builtins__=dict(snapshot[0]))
    try:
        exec(compile(tests, "test.py", "exec"), scope)
    except SystemExit as e:
        _exited(e)
    write(verdict, ("\\n" + nonce + "\\n").encode())
    exit(0)


_main()
"""

# Function-call tests: the call (function name and arguments) is stdin's payload; the result is
# written after the nonce, so that prints of the candidate cannot be taken for it.
_CALL_HARNESS = _PRELUDE + """\
import contextlib, io, json


def _encode(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return repr(value)


def _main(dumps=json.dumps, write=os.write, exit=os._exit):
    nonce, call, verdict = _take_stdin()
    spec = json.loads(call)
    snapshot = _snapshot()
    namespace = {"__name__": "solution", "__file__": "solution.py"}
    with contextlib.redirect_stdout(io.StringIO()):
        _run_program(namespace, snapshot)
        fn = namespace.get(spec["fn"])
        if fn is None and isinstance(namespace.get("Solution"), type):
            fn = getattr(namespace["Solution"](), spec["fn"], None)
        if fn is None:
            raise NameError("function %r is not defined" % spec["fn"])
        try:
            result = fn(*spec["args"])
        except SystemExit as e:
            _exited(e)
    write(verdict, ("\\n" + nonce + dumps(result, default=_encode) + "\\n").encode())
    exit(0)


_main()
"""


class Runner(Protocol):
    """What the reward needs from a sandbox: `Sandbox` and `SandboxPool` both qualify."""

    async def run(
        self,
        code: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult: ...


class CodeRewardConfig(BaseModel):
    """Settings of the code reward."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    credit: Literal["all_or_nothing", "fractional"] = "all_or_nothing"
    """``all_or_nothing``: 1.0 if every test passes else 0.0. ``fractional``: passed / total."""
    time_limit_s: float = Field(6.0, gt=0, le=600)
    """Per-test wall-clock and CPU limit."""
    memory_bytes: int = Field(1 << 30, ge=32 << 20)
    """Per-test memory (address space) limit; accepts "512M"-style strings."""
    max_tests: int | None = Field(None, ge=1)
    """Use at most this many tests of a sample (the first ones); ``None``: all."""
    parallel_tests: int = Field(4, ge=1, le=256)
    """Tests of one sample that run at the same time."""
    float_tolerance: float = Field(1e-6, ge=0)
    """Absolute and relative tolerance when comparing numbers."""

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _size(cls, value: int | str) -> int:
        return parse_size(value)


@dataclass
class TestCase:
    kind: Literal["stdio", "call", "program"]
    input: Any = None
    """stdio: the stdin text; call: the argument list; program: test code run after the candidate
    (in its namespace)."""
    expected: Any = None


def extract_code(response: str) -> tuple[str, bool]:
    """The program in ``response``: the last ```python block (else the last fenced block of no
    language), or the whole response when it has none. Returns ``(code, from_markdown)``."""
    blocks = [(m.group(1).lower(), m.group(2).rstrip()) for m in _FENCE.finditer(response)]
    for wanted in (_PYTHON_TAGS, {""}):
        chosen = [body for tag, body in blocks if tag in wanted]
        if chosen:
            return chosen[-1], True
    return response, False


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def _json_args(text: str) -> list[Any]:
    return [json.loads(line) for line in str(text).splitlines() if line.strip()]


def _fn_name(spec: Any, metadata: Mapping[str, Any]) -> str | None:
    nested = metadata.get("metadata") if isinstance(metadata.get("metadata"), Mapping) else {}
    for source in (spec if isinstance(spec, Mapping) else {}, metadata, nested):
        for key in ("fn_name", "func_name", "entry_point"):
            if source.get(key):
                return str(source[key])
    return None


def parse_tests(
    answer: str | Mapping | Sequence | None, metadata: Mapping[str, Any]
) -> tuple[list[TestCase], str | None]:
    """Test cases and the function name (call style) from a sample's ``answer``."""
    if answer is None:
        raise ValueError("the code reward needs test cases (JSON) in RewardSample.answer")
    spec = json.loads(answer) if isinstance(answer, str) else answer
    fn = _fn_name(spec, metadata)
    if isinstance(spec, Mapping) and "inputs" in spec:
        pairs = list(zip(spec["inputs"], spec["outputs"], strict=True))
        if fn:
            return [TestCase("call", a if isinstance(a, list) else [a], b) for a, b in pairs], fn
        return [TestCase("stdio", _text(a), _text(b)) for a, b in pairs], None
    if isinstance(spec, Mapping) and "test" in spec:
        check = f"{spec['test']}\n\ncheck({spec['entry_point']})\n"
        return [TestCase("program", check)], None
    if isinstance(spec, Mapping) and "asserts" in spec:
        setup = spec.get("setup", "")
        return [TestCase("program", f"{setup}\n{line}\n") for line in spec["asserts"]], None
    items = spec.get("tests") if isinstance(spec, Mapping) else spec
    if not isinstance(items, list) or not all(isinstance(t, Mapping) for t in items):
        raise ValueError("unrecognised test-case format; see reroll.rewards.code for the shapes")
    cases = []
    for item in items:
        if item.get("testtype") == "functional":
            if not fn:
                raise ValueError("functional tests need a function name (fn_name / func_name)")
            cases.append(TestCase("call", _json_args(item["input"]), json.loads(item["output"])))
        else:
            cases.append(TestCase("stdio", _text(item["input"]), _text(item["output"])))
    return cases, fn


def _numbers_close(a: str, b: str, tol: float) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=tol, abs_tol=tol)


def outputs_match(actual: str, expected: str, tol: float = 1e-6) -> bool:
    """stdout comparison as judges do it: trailing whitespace and blank lines are ignored, then
    tokens are compared, numbers within ``tol``."""
    if actual == expected:
        return True
    lines = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    if lines(actual) == lines(expected):
        return True
    got, want = actual.split(), expected.split()
    if len(got) != len(want):
        return False
    return all(g == w or _numbers_close(g, w, tol) for g, w in zip(got, want, strict=True))


def values_match(actual: Any, expected: Any, tol: float = 1e-6) -> bool:
    """Return-value comparison: tuples equal lists, numbers within ``tol``."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return isinstance(actual, bool) and isinstance(expected, bool) and actual == expected
    if isinstance(actual, int | float) and isinstance(expected, int | float):
        return math.isclose(actual, expected, rel_tol=tol, abs_tol=tol)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(
            values_match(a, e, tol) for a, e in zip(actual, expected, strict=True)
        )
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            values_match(actual[k], expected[k], tol) for k in actual
        )
    return actual == expected


@dataclass
class CaseOutcome:
    passed: bool
    reason: str
    """``passed``, ``wrong_answer``, ``runtime_error``, ``time_limit``, ``memory_limit``,
    ``output_limit``, another limit name, or ``sandbox_error``."""
    detail: str = ""
    seconds: float = 0.0


_LIMIT_REASONS = {
    "wall_time": "time_limit",
    "cpu_time": "time_limit",
    "memory": "memory_limit",
    "output": "output_limit",
}


def _failure(result: ExecResult) -> CaseOutcome | None:
    if result.limit is not None:
        reason = _LIMIT_REASONS.get(result.limit, result.limit)
        return CaseOutcome(False, reason, result.stderr[-_DETAIL_CHARS:], result.wall_s)
    if result.exit_code != 0:
        detail = result.stderr[-_DETAIL_CHARS:] or f"exit code {result.exit_code}"
        return CaseOutcome(False, "runtime_error", detail, result.wall_s)
    return None


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= 120 else text[:117] + "..."


class CodeRewardFn:
    """``RewardFn`` that scores a program by the test cases it passes (see the module docstring).

    ``sandbox`` is anything with `Sandbox.run`'s signature — pass a shared `SandboxPool` to bound
    concurrency across samples and reuse warm sandboxes. Without one, a private `Sandbox` is made
    on first use (so the reward stays picklable for process pools)."""

    name = "code"

    def __init__(
        self,
        config: CodeRewardConfig | None = None,
        sandbox: Runner | None = None,
        **overrides: Any,
    ) -> None:
        base = config or CodeRewardConfig()
        self.config = CodeRewardConfig(**{**base.model_dump(), **overrides}) if overrides else base
        self._sandbox = sandbox
        self._owns_sandbox = sandbox is None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._owns_sandbox:
            state["_sandbox"] = None
        return state

    @property
    def sandbox(self) -> Runner:
        if self._sandbox is None:
            self._sandbox = Sandbox()
        return self._sandbox

    async def __call__(self, sample: RewardSample) -> RewardResult:
        cases, fn = parse_tests(sample.answer, sample.metadata)
        if self.config.max_tests is not None:
            cases = cases[: self.config.max_tests]
        code, from_markdown = extract_code(sample.response)
        info: dict[str, Any] = {"total": len(cases), "extracted_from_markdown": from_markdown}
        if not code.strip() or not cases:
            first = {
                "test": None,
                "reason": "no_code" if not code.strip() else "no_tests",
                "detail": "",
            }
            return RewardResult(0.0, {**info, "passed": 0, "first_failure": first, "statuses": []})
        outcomes = await self._run_cases(code, cases, fn, sample.metadata)
        passed = sum(o is not None and o.passed for o in outcomes)
        statuses = [o.reason if o is not None else "skipped" for o in outcomes]
        failed = next(
            ((i, o) for i, o in enumerate(outcomes) if o is not None and not o.passed), None
        )
        first = (
            None
            if failed is None
            else {"test": failed[0], "reason": failed[1].reason, "detail": failed[1].detail}
        )
        if self.config.credit == "fractional":
            score = passed / len(cases)
        else:
            score = 1.0 if passed == len(cases) else 0.0
        info.update(passed=passed, first_failure=first, statuses=statuses)
        info["seconds"] = sum(o.seconds for o in outcomes if o is not None)
        return RewardResult(score, info)

    async def _run_cases(
        self, code: str, cases: list[TestCase], fn: str | None, metadata: Mapping[str, Any]
    ) -> list[CaseOutcome | None]:
        """Run the tests, ``parallel_tests`` at a time. All-or-nothing stops (and kills what is
        running) at the first failure; the tests it did not finish stay ``None`` ("skipped")."""
        time_limit = float(metadata.get("time_limit_s", self.config.time_limit_s))
        limits = Limits(
            wall_time_s=time_limit, cpu_time_s=time_limit, memory_bytes=self.config.memory_bytes
        )
        gate = asyncio.Semaphore(self.config.parallel_tests)
        stop_early = self.config.credit == "all_or_nothing"

        async def one(case: TestCase) -> CaseOutcome:
            async with gate:
                return await self._run_case(code, case, fn, limits)

        tasks = [asyncio.ensure_future(one(case)) for case in cases]
        try:
            for finished in asyncio.as_completed(tasks):
                outcome = await finished
                if stop_early and not outcome.passed:
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [
            t.result() if t.done() and not t.cancelled() and t.exception() is None else None
            for t in tasks
        ]

    async def _run_case(
        self, code: str, case: TestCase, fn: str | None, limits: Limits
    ) -> CaseOutcome:
        try:
            if case.kind == "stdio":
                expected = str(case.expected)
                out_cap = max(limits.output_bytes, 2 * len(expected.encode()) + (64 << 10))
                result = await self.sandbox.run(
                    code,
                    stdin=case.input,
                    limits=limits.model_copy(update={"output_bytes": out_cap}),
                )
                return _failure(result) or self._compare_stdout(result, expected)
            if case.kind == "program":
                return await self._run_program(code, case, limits)
            return await self._run_call(code, case, fn or "", limits)
        except SandboxError as exc:
            return CaseOutcome(False, "sandbox_error", str(exc)[:_DETAIL_CHARS])

    def _compare_stdout(self, result: ExecResult, expected: str) -> CaseOutcome:
        if outputs_match(result.stdout, expected, self.config.float_tolerance):
            return CaseOutcome(True, "passed", "", result.wall_s)
        detail = f"expected {_short(expected)!r}, got {_short(result.stdout)!r}"
        return CaseOutcome(False, "wrong_answer", detail, result.wall_s)

    async def _run_program(self, code: str, case: TestCase, limits: Limits) -> CaseOutcome:
        """A pass is the harness's nonce on stdout, written only after the test code returned;
        the exit code alone proves nothing (the program may exit 0 before the tests)."""
        nonce = secrets.token_hex(16)
        result = await self.sandbox.run(
            _PROGRAM_HARNESS, files={"solution.py": code}, stdin=f"{nonce}\n{case.input}",
            limits=limits)
        failure = _failure(result)
        if failure is not None:
            return failure
        if f"\n{nonce}\n" not in result.stdout:
            return CaseOutcome(False, "runtime_error", "the tests did not run to completion "
                               "(the program ended the process first)", result.wall_s)
        return CaseOutcome(True, "passed", "", result.wall_s)

    async def _run_call(self, code: str, case: TestCase, fn: str, limits: Limits) -> CaseOutcome:
        marker = secrets.token_hex(16)
        call = json.dumps({"fn": fn, "args": case.input})
        result = await self.sandbox.run(
            _CALL_HARNESS, files={"solution.py": code}, stdin=f"{marker}\n{call}", limits=limits
        )
        failure = _failure(result)
        if failure is not None:
            return failure
        _, found, payload = result.stdout.rpartition(marker)
        try:
            value = json.loads(payload) if found else None
        except json.JSONDecodeError:
            found = ""
        if not found:
            return CaseOutcome(
                False, "runtime_error", "the function returned no readable result", result.wall_s
            )
        expected = case.expected
        ok = values_match(value, expected, self.config.float_tolerance) or (
            isinstance(expected, list)
            and len(expected) == 1
            and values_match(value, expected[0], self.config.float_tolerance)
        )
        if ok:
            return CaseOutcome(True, "passed", "", result.wall_s)
        return CaseOutcome(
            False,
            "wrong_answer",
            f"expected {_short(expected)}, got {_short(value)}",
            result.wall_s,
        )
