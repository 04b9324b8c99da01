"""The documentation against the repository: links resolve (files and BENCHMARKS.md headings), docs/ARCHITECTURE.md
names only files that exist, the README's option table lists every engine option, the offline lm-eval tasks of
docs/evaluation.md load, and no doc speaks of how the project was built. Reads files only (seconds)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from serving.config import FLAT_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "BENCHMARKS.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve(doc):
    path = ROOT / doc
    bad = []
    for target in LINK.findall(path.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(target)
        elif anchor and anchor not in _anchors(dest):
            bad.append(target)
    assert not bad, f"{doc}: broken links {bad}"


def test_architecture_names_only_files_that_exist():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    present = {p for p in tracked if (ROOT / p).exists()} | {
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts
    }
    basenames = {os.path.basename(p) for p in present}
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    names = set(re.findall(r"[\w/.-]+\.(?:py|sh|md|toml)\b", text))
    missing = [n for n in sorted(names) if (n not in present if "/" in n else n not in basenames)]
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"


def test_readme_lists_every_engine_option_and_the_models_region():
    readme = (ROOT / "README.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", readme, flags=re.M))
    assert set(FLAT_OPTIONS) <= rows, sorted(set(FLAT_OPTIONS) - rows)
    begin, end = readme.find("<!-- supported-models:begin -->"), readme.find("<!-- supported-models:end -->")
    assert 0 < begin < end, "the supported-models region markers are missing"
    assert "`gemma3-270m`" in readme and "base model" in readme


@pytest.mark.parametrize("doc", DOCS)
def test_docs_speak_of_the_product(doc):
    text = (ROOT / doc).read_text()
    hits = re.findall(r"(?i)\bsession\s*\d+|\bissue\s*\d+|\bcalls?\s+\d+|\bround\s+\d+", text)
    assert not hits, f"{doc}: {hits[:5]}"


def test_example_lm_eval_tasks_load_offline():
    """lm-eval's task manager reads the example tasks from their local files with the hub switched off."""
    pytest.importorskip("lm_eval")
    code = """
from lm_eval.tasks import TaskManager
tasks = TaskManager(include_path="examples/lm_eval_task", include_defaults=False).load_task_or_group(
    ["tiny_facts", "held_out_ppl"])
mc, ppl = tasks["tiny_facts"], tasks["held_out_ppl"]
docs = list(mc.test_docs())
print(len(docs), mc.doc_to_text(docs[0]), mc.doc_to_choice(docs[0]), mc.doc_to_target(docs[2]))
print(len(list(ppl.test_docs())), mc.OUTPUT_TYPE, ppl.OUTPUT_TYPE)
"""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = r.stdout.strip().splitlines()[-2:]
    assert first == "4 The capital of France is ['Paris', 'London', 'Madrid'] 2"
    assert second == "2 multiple_choice loglikelihood_rolling"


def _program_defines(source: str, flag: str) -> bool:
    """Whether a program's source defines --flag: argparse ("--flag"), absl ("flag"), or a defaults dict (flag=)."""
    return bool(re.search(rf"[\"']-*{flag}[\"']|\b{flag}=", source))


def test_gpu_runner_and_benchmarks_name_programs_that_exist():
    """benchmarks/gpu.sh runs programs of this repository with flags each program defines; BENCHMARKS.md's commands
    name programs that exist."""
    runner = (ROOT / "benchmarks" / "gpu.sh").read_text()
    bench = (ROOT / "BENCHMARKS.md").read_text()
    named = set(re.findall(r"benchmarks/\w+\.(?:py|sh)", runner + bench)) | {
        f"benchmarks/{m}.py" for m in re.findall(r"-m benchmarks\.(\w+)", bench)
    }
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, missing
    programs = {r"\$PROFILE": ROOT / "benchmarks" / "engine_latency.py"}
    programs |= {r"\bdecode \d+ ": ROOT / "benchmarks" / "decode_llama.py"}
    programs |= {r"-m serving\.train_heads": ROOT / "serving" / "train_heads.py"}
    unknown = []
    for line in runner.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("#") or not re.search(r"python3 |\bdecode \d+ ", line):
            continue
        match = re.search(r"benchmarks/(\w+)\.py", line)
        path = ROOT / "benchmarks" / f"{match.group(1)}.py" if match else None
        path = path or next((p for pattern, p in programs.items() if re.search(pattern, line)), None)
        if path is None:
            continue
        source = path.read_text()  # and the benchmark modules it imports (shared argument parsers)
        source += "".join(
            (path.parent / f"{m}.py").read_text() for m in re.findall(r"from benchmarks import (\w+)", source)
        )
        unknown += [
            f"{path.name} --{f}" for f in re.findall(r"--([a-z][a-z_0-9]+)", line) if not _program_defines(source, f)
        ]
    assert not unknown, f"benchmarks/gpu.sh passes flags its programs do not define: {unknown}"
    r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
