"""The captured decode's walls (issue 41): what runs inside a captured step, who plans its replay, which
kernel it reaches whatever the capture state, and how the CUDA-only code and tests stay reachable only where
they should be. The layering walls are in ``test_structure.py``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_structure import PACKAGE, ROOT, _sources


def _mentions(name: str, root: Path = PACKAGE) -> list[str]:
    """The source files under ``root`` whose code (not only their text) names ``name``."""
    found = []
    for p in _sources(root):
        for node in ast.walk(ast.parse(p.read_text())):
            if ((isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute)
                                                                     and node.attr == name)
                    or (isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name)):
                found.append(str(p.relative_to(PACKAGE)))
                break
    return sorted(found)


def test_the_servers_dispatch_cannot_reach_the_gloo_twin():
    """The symm_mem exchange's gloo twin (its CPU test double) is named only beside the exchange itself."""
    assert _mentions("GlooExchange") == ["moe/dispatch/exchange.py"]


def test_a_captured_decode_is_planned_in_one_place():
    """Only the captured decode asks the kernels to plan a replay; only FlashInfer's graph mode plans one."""
    assert _mentions("plan_replay") == ["engine/graphs.py", "kernels/decode_plan.py"]
    callers = [str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE / "kernels")
               if re.search(r"^\s*(decode_plan\.)?register\(", p.read_text(), re.M) and p.name != "decode_plan.py"]
    assert callers == ["kernels/mla_flashinfer_graph.py"]
    assert "epserve" not in "".join(re.findall(r"^(?:from|import) .*$", (PACKAGE / "kernels/decode_plan.py")
                                               .read_text(), re.M))


def test_a_captured_step_reads_nothing_back_and_stages_its_inputs_once():
    """The captured decode's host side: one staging of the step's host values (``DeviceTables.stage``), no
    device value read back on the host."""
    files = {name: (PACKAGE / "engine" / name).read_text() for name in ("graphs.py", "captured.py", "block_tables.py")}
    for name, text in files.items():
        assert not re.search(r"\.(tolist|item|cpu)\(\)", text), name
    assert [name for name, text in files.items() if "torch.tensor(" in text] == ["block_tables.py"]
    assert files["block_tables.py"].count("torch.tensor(") == 1


def test_capture_state_changes_no_kernel_choice():
    """Whether the stream is capturing is asked only where it raises or picks a stream, never to choose a kernel."""
    askers = [str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE)
              if "is_current_stream_capturing" in p.read_text()]
    assert sorted(askers) == ["kernels/backends.py", "kernels/mla_flashinfer.py", "kernels/mla_flashinfer_graph.py",
                              "model/streams.py"]


def test_cuda_tests_carry_the_mark():
    """A CUDA-only test is marked ``cuda`` (the GPU check selects by it), never skipped by its own condition."""
    skippers = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("*.py"))
                if re.search(r"skipif\(\s*not torch\.cuda\.is_available\(\)", p.read_text())]
    assert skippers == []
