"""JUnit XML for a CI's test tab: one test case per output compared (a ``failure`` with the
error statistics when it mismatched), per CI gate, and per embedded rule test.

Built with ``xml.etree`` so every string is escaped; characters XML 1.0 cannot carry at
all (control characters in a hostile node name) are replaced by ``\\xNN`` first, or the
file would not parse.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any

from .common import (
    dispatch,
    human_bytes,
    mismatch_summary,
    output_label,
    output_status,
    percent,
    sample_count,
)

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(value: object) -> str:
    """``value`` as text XML 1.0 can hold (escaping of <, & and quotes is etree's job)."""
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))


def _element(parent: ET.Element, tag: str, text: str | None = None, **attrs: object
             ) -> ET.Element:
    node = ET.SubElement(parent, tag, {k: xml_text(v) for k, v in attrs.items()})
    if text is not None:
        node.text = xml_text(text)
    return node


class _Suite:
    """A ``testsuite`` that keeps its own counts."""

    def __init__(self, root: ET.Element, name: str, properties: Mapping[str, object]):
        self.node = _element(root, "testsuite", name=name)
        self.counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        self.time = 0.0
        if properties:
            props = _element(self.node, "properties")
            for key, value in properties.items():
                _element(props, "property", name=key, value=value)

    def case(self, classname: str, name: str, *, seconds: float = 0.0,
             failure: tuple[str, str] | None = None, error: tuple[str, str] | None = None,
             skipped: str | None = None, output: str | None = None,
             **attrs: object) -> None:
        case = _element(self.node, "testcase", classname=classname, name=name,
                        time=f"{seconds:.4f}", **attrs)
        self.counts["tests"] += 1
        self.time += seconds
        for kind, content in (("failure", failure), ("error", error)):
            if content is not None:
                message, details = content
                _element(case, kind, details, message=message, type=kind)
                self.counts[f"{kind}s"] += 1
        if skipped is not None:
            _element(case, "skipped", message=skipped)
            self.counts["skipped"] += 1
        if output:
            _element(case, "system-out", output)

    def close(self) -> None:
        for key, value in self.counts.items():
            self.node.set(key, str(value))
        self.node.set("time", f"{self.time:.4f}")


def _document(suites: Sequence[_Suite], root: ET.Element) -> str:
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        suite.close()
        for key in totals:
            totals[key] += suite.counts[key]
    for key, value in totals.items():
        root.set(key, str(value))
    root.set("time", f"{sum(s.time for s in suites):.4f}")
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def add_validation(suite: _Suite, classname: str, validation: Mapping[str, Any] | None,
                   seconds: float = 0.0) -> None:
    """One test case per output compared on onnxruntime (per input set when several)."""
    if validation is None:
        suite.case(classname, "validation", skipped="validation skipped (--no-validate)")
        return
    outputs = list(validation.get("outputs") or [])
    if validation.get("error"):
        suite.case(classname, "onnxruntime run", error=("the models could not be compared",
                                                        str(validation["error"])))
    samples = sample_count(outputs)
    share = seconds / len(outputs) if outputs else 0.0
    for out in outputs:
        status = output_status(out)
        label = output_label(out, samples)
        details = (f"output {out.get('name')} ({out.get('dtype')}{list(out.get('shape', []))}): "
                   + mismatch_summary(out))
        if status == "MISMATCH":
            suite.case(classname, label, seconds=share,
                       failure=(f"outputs differ: {mismatch_summary(out)}", details))
        elif status == "non-deterministic":
            suite.case(classname, label, seconds=share,
                       skipped="the reference itself is non-deterministic on this output")
        else:
            suite.case(classname, label, seconds=share, output=details)


def add_reverts(suite: _Suite, bisection: Mapping[str, Any] | None) -> None:
    """One failed test case per rule application that changed outputs and was reverted;
    the details are the mismatched outputs of the run with every rule applied."""
    if not bisection:
        return
    initial = (bisection.get("initial_validation") or {}).get("outputs") or []
    evidence = "\n".join(f"output {o.get('name')} [sample {o.get('sample', 0)}]: "
                         f"{mismatch_summary(o)}" for o in initial if not o.get("passed"))
    unverified = {(a.get("rule"), tuple(a.get("matched") or ())) for a in
                  bisection.get("unverified") or []}
    for app in bisection.get("reverted") or []:
        nodes = ", ".join(str(n) for n in app.get("matched") or [])
        why = ("reverted without proof (bisection budget ran out)"
               if (app.get("rule"), tuple(app.get("matched") or ())) in unverified
               else "changed outputs; reverted")
        suite.case("fusectl.revert", f"{app.get('rule')} on {nodes}",
                   failure=(f"rule {app.get('rule')} on {nodes}: {why}", evidence or why))


def add_gates(suite: _Suite, gates: Sequence[Mapping[str, Any]]) -> None:
    """One test case per CI gate (``--fail-under-saved`` and friends)."""
    for gate in gates:
        message = str(gate.get("message", ""))
        suite.case("fusectl.gate", str(gate.get("gate", "gate")),
                   failure=None if gate.get("passed") else (message, message),
                   output=message if gate.get("passed") else None)


def _optimize(doc: Mapping[str, Any]) -> str:
    model = str(doc.get("model") or "model")
    traffic = doc.get("traffic") or {}
    before, after = int(traffic.get("bytes_before", 0)), int(traffic.get("bytes_after", 0))
    root = ET.Element("testsuites", name="fusectl")
    suite = _Suite(root, f"fusectl optimize {model}", {
        "fusectl_version": doc.get("fusectl_version", ""),
        "model": model,
        "output": doc.get("output") or "",
        "traffic_before": human_bytes(before),
        "traffic_after": human_bytes(after),
        "percent_saved": f"{percent(before - after, before):.2f}",
        "rule_applications": len(doc.get("applications") or []),
    })
    seconds = float((doc.get("seconds") or {}).get("validate", 0.0))
    add_validation(suite, "fusectl.validation", doc.get("validation"), seconds)
    add_reverts(suite, doc.get("bisection"))
    add_gates(suite, list(doc.get("gates") or []))
    return _document([suite], root)


def _split_location(location: str) -> dict[str, str]:
    path, sep, line = location.rpartition(":")
    return {"file": path, "line": line} if sep and line.isdigit() else {"file": location}


def _rule_tests(doc: Mapping[str, Any]) -> str:
    root = ET.Element("testsuites", name="fusectl")
    suite = _Suite(root, "fusectl rules test", {"fusectl_version": doc.get("fusectl_version", "")})
    for test in doc.get("tests") or []:
        problems = [str(p) for p in test.get("problems") or []]
        failure = None
        if not test.get("passed"):
            failure = (problems[0] if problems else "rule test failed", "\n".join(problems))
        suite.case(str(test.get("rule", "?")), str(test.get("test", "?")),
                   seconds=float(test.get("seconds") or 0.0), failure=failure,
                   **_split_location(str(test.get("location", ""))))
    return _document([suite], root)


def _signature_problems(io: Mapping[str, Any]) -> list[str]:
    problems = []
    for side in ("inputs", "outputs"):
        part = io.get(side) or {}
        problems += [f"{side}: {s.get('name')} added" for s in part.get("added") or []]
        problems += [f"{side}: {s.get('name')} removed" for s in part.get("removed") or []]
        problems += [f"{side}: {c.get('name')} {c.get('a')} -> {c.get('b')}"
                     for c in part.get("changed") or []]
    return problems


def _diff(doc: Mapping[str, Any]) -> str:
    """The checks of ``fusectl diff``: the IO signature, then every output compared."""
    a, b = str(doc.get("a", "A")), str(doc.get("b", "B"))
    root = ET.Element("testsuites", name="fusectl")
    suite = _Suite(root, f"fusectl diff {a} {b}", {
        "fusectl_version": doc.get("fusectl_version", ""), "a": a, "b": b,
        "identical": str(bool(doc.get("identical"))).lower()})
    io = doc.get("io") or {}
    problems = _signature_problems(io)
    suite.case("fusectl.diff", "IO signature",
               failure=None if io.get("same", not problems) else
               ("the IO signatures differ", "\n".join(problems) or "the IO signatures differ"))
    validation = doc.get("validation")
    if validation is None and doc.get("validation_skipped"):
        suite.case("fusectl.validation", "validation", skipped=doc["validation_skipped"])
    elif validation is not None:
        add_validation(suite, "fusectl.validation", validation)
    return _document([suite], root)


RENDERERS = {"fusectl.optimize": _optimize, "fusectl.rules-test": _rule_tests,
              "fusectl.diff": _diff}


def render(doc: Mapping[str, Any]) -> str:
    """The JUnit XML report of ``doc`` (dispatched on its ``schema``)."""
    return dispatch(doc, RENDERERS, "JUnit")
