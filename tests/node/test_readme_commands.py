"""The README's and docs/demo.md's commands typed on the demo's cluster, as a user types them.

The cluster is the one `make demo DEMO_ARGS=--keep` keeps (tests.harness.kept_demo), used through
the shell the demo prints (its `export KUBECONFIG=...`, `export PATH=...` lines) and stopped as it
says. Every fenced block of README.md is one of:
* a `console` block: each `$ ` line is run as typed, in order, in one directory; the lines shown
  under a command are exactly what it prints;
* a sample of what a command the demo suggests prints (by the block's first line): the sample's
  lines are that command's output, in order (`why`'s exactly, but its last hint line);
* the synopsis of `dra-driver`'s commands: each flag it shows is in that command's --help;
* one of the blocks not run here, each with its reason (NOT_RUN).
A block of no known kind fails, so a new command in the README gets typed here too.
docs/demo.md's "real run" must be a run of this demo: the same report sections, pods and summary.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.kept_demo import ROOT, KeptDemo, kept_demo

README = ROOT / "README.md"
DEMO_DOC = ROOT / "docs" / "demo.md"

# a sample's first line -> the command (one the demo suggests) that prints it
OUTPUT_OF = {
    "gpu-0 is in MIG mode": "kubectl gpu h200-mig",
    "pod gpu-demo/too-big-200gi:": "kubectl gpu why -n gpu-demo too-big-200gi",
}
# a block's first line -> why it is not typed here
NOT_RUN = {
    "make demo ": "`make demo` is what keeps this cluster; `make test` is what runs this test",
    "helm install ": "needs the image pushed to a registry the nodes pull from (tests/node/test_helm.py)",
    " NVML (pynvml)": "a diagram",
}
SYNOPSIS = "dra-driver inventory"
# names the API server makes (generateName) and the demo's placement of MIG slices keeps
_GENERATED = re.compile(r"\b((?:too-big-200gi|linked-3)-gpus?-)[a-z0-9]{5}\b")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    lines: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    text = path.read_text().splitlines()
    i = 0
    while i < len(text):
        opening = re.fullmatch(r"```(\w*)", text[i])
        if opening:
            end = text.index("```", i + 1)
            found.append(Block(path, i + 1, opening[1], tuple(text[i + 1:end])))
            i = end
        i += 1
    return found


def kind(block: Block) -> str:
    first = block.lines[0] if block.lines else ""
    if block.lang == "console":
        return "typed"
    if any(first.startswith(k) for k in OUTPUT_OF):
        return "output"
    if any(first.startswith(k) for k in NOT_RUN):
        return "not run"
    if first.startswith(SYNOPSIS):
        return "synopsis"
    return "unknown"


def normalized(lines: list[str] | tuple[str, ...]) -> list[str]:
    return [_GENERATED.sub(r"\1XXXXX", line.rstrip()) for line in lines]


@pytest.fixture(scope="module")
def demo() -> Iterator[KeptDemo]:
    with kept_demo() as kept:
        yield kept


def test_every_readme_block_is_of_a_kind_this_test_runs() -> None:
    unknown = [f"{b.where}: {b.lines[:1]}" for b in blocks(README) if kind(b) == "unknown"]
    assert not unknown, f"README blocks this test does not know how to type: {unknown}"
    kinds = {kind(b) for b in blocks(README)}
    assert {"typed", "output", "synopsis"} <= kinds


def test_the_demo_says_how_to_use_it_and_what_to_type(demo: KeptDemo, tmp_path: Path) -> None:
    assert "KUBECONFIG" in demo.env and demo.pid > 0
    assert set(OUTPUT_OF.values()) <= set(demo.suggested), demo.suggested
    for command in demo.suggested:
        done = demo.shell(command, tmp_path)
        assert done.returncode == 0, f"{command}: {done.stderr}"


def test_console_blocks_run_as_typed(demo: KeptDemo, tmp_path: Path) -> None:
    typed = [b for b in blocks(README) if kind(b) == "typed"]
    assert typed
    for block in typed:
        commands = [(n, line[2:]) for n, line in enumerate(block.lines) if line.startswith("$ ")]
        assert commands, f"{block.where}: a console block with no `$ ` line"
        for index, (n, command) in enumerate(commands):
            shown = list(block.lines[n + 1:commands[index + 1][0] if index + 1 < len(commands) else None])
            done = demo.shell(command, tmp_path)
            assert done.returncode == 0, f"{block.where}: {command}: {done.stdout}{done.stderr}"
            if shown:
                printed = (done.stdout + done.stderr).splitlines()
                assert normalized(printed) == normalized(shown), f"{block.where}: {command}"


def test_samples_are_what_the_commands_print_on_the_demo(demo: KeptDemo, tmp_path: Path) -> None:
    readme = README.read_text()
    for block in (b for b in blocks(README) if kind(b) == "output"):
        command = next(c for first, c in OUTPUT_OF.items() if block.lines[0].startswith(first))
        assert command in readme, f"{block.where}: the README does not say `{command}` prints it"
        done = demo.shell(command, tmp_path)
        assert done.returncode == 0, done.stderr
        printed, sample = normalized(done.stdout.splitlines()), normalized(block.lines)
        if command.startswith("kubectl gpu why"):
            assert printed[-1].startswith("(-v")  # the hint the sample leaves out
            assert sample == printed[:-1], block.where
        else:  # an excerpt: the sample's lines in the order printed
            rest = iter(printed)
            missing = [line for line in sample if line not in rest]
            assert not missing, f"{block.where}: not printed in this order: {missing}\n{done.stdout}"


def test_the_synopsis_shows_only_flags_the_commands_take(demo: KeptDemo, tmp_path: Path) -> None:
    (synopsis,) = [b for b in blocks(README) if kind(b) == "synopsis"]
    for line in synopsis.lines:
        words = line.split("#")[0].replace("[", " ").replace("]", " ").replace("|", " ").split()
        command = [w for w in words[: next((i for i, w in enumerate(words) if w.startswith("-")), len(words))]
                   if re.fullmatch(r"[a-z-]+", w)]
        done = demo.shell(" ".join([*command, "--help"]), tmp_path)
        assert done.returncode == 0, f"{line}: {done.stderr}"
        for flag in (w for w in words if w.startswith("-")):
            assert re.search(rf"(^|[\s,]){re.escape(flag)}\b", done.stdout), f"{' '.join(command)}: no {flag}"


def _report(lines: list[str] | tuple[str, ...]) -> tuple[list[str], list[str], str]:
    """(section titles, pods, the summary without its seconds) of a demo report."""
    body = [line.rstrip() for line in lines]
    titles = [body[i] for i in range(len(body) - 1) if body[i] and re.fullmatch(r"=+", body[i + 1])]
    pods = sorted(m[1] for line in body if (m := re.match(r"([\w-]+/[\w-]+)( -> node \S+)?: \w+", line)))
    summary = next(body[i + 2] for i, line in enumerate(body) if line == "Summary")
    return titles, pods, re.sub(r"; [\d.]+s$", "", summary)


def test_the_demo_doc_shows_a_run_of_this_demo(demo: KeptDemo) -> None:
    (sample,) = [b for b in blocks(DEMO_DOC) if any(line.startswith("Summary") for line in b.lines)]
    assert _report(sample.lines) == _report(demo.lines)
    for command in ("make demo", "make demo DEMO_ARGS=--keep"):
        assert f"`{command}`" in DEMO_DOC.read_text()


def test_stopping_it_as_it_says_tears_everything_down(demo: KeptDemo) -> None:
    assert demo.stop() == 0, demo.output[-2000:]
    assert "torn down: drivers, kubelets, containerd and the control plane stopped" in demo.output
