"""transformers' own modeling tests for DeepSeek-V3 and Qwen3-MoE, plain and with hpmoe blocks.

    python benchmarks/transformers_suite.py --sdist transformers-5.23.0.tar.gz \\
        --repo /path/to/transformers            # a checkout or a bare git dir (--rev, default HEAD)

Plan:
  1. Assemble a test tree in ``--workdir``: the per-model test files and the helpers the
     sdist does not ship (``causal_lm_tester.py``, ``generation/test_utils.py``,
     ``exporters/test_export.py``, ``utils/test_configuration_utils.py``) from ``--repo``, then
     every ``tests/*.py`` of the sdist over them (the installed version's common tests win).
     ``src/transformers`` links to the installed package.  A helper that neither holds is
     written as a stub that skips (``run_distributed``: tensor-parallel and FSDP tests need
     several processes).
  2. Write a ``conftest.py`` that, when ``HPMOE_SUITE_REPLACE=1``, wraps
     ``PreTrainedModel.post_init`` to call ``hpmoe.replace_moe_blocks`` on every model the
     tests build (``--virtual-ep`` ranks in one process where they divide the model's
     experts, else 1; ``--path taskflow``, the default, makes every region run the tile
     taskflow, ``--path auto`` keeps the layers' default, AUTO).
  3. Run pytest twice (plain, hpmoe) offline (``HF_HUB_OFFLINE=1``: tests that need the
     network fail or skip in both runs alike) and read each run's JUnit XML.
  4. Print per-test outcomes, the counts, and every test that passes only without hpmoe.

transformers' test files are Apache-2.0; they are read from the given paths, not vendored.
Exit status 1 when some test passes only without hpmoe.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import transformers

from hpmoe.machine import record

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("deepseek_v3", "qwen3_moe")
REPO_FILES = (
    "tests/__init__.py",
    "tests/causal_lm_tester.py",
    "tests/generation/__init__.py",
    "tests/generation/test_utils.py",
    "tests/exporters/__init__.py",
    "tests/exporters/test_export.py",
    "tests/utils/__init__.py",
    "tests/utils/test_configuration_utils.py",
    "tests/utils/tiny_model_summary.json",
    "tests/models/__init__.py",
    "utils/test_module/__init__.py",
    "utils/test_module/custom_configuration.py",
    *(f"tests/models/{m}/{f}" for m in MODELS for f in ("__init__.py", f"test_modeling_{m}.py")),
)
STUBS = {
    "tests/distributed_testing_utils.py": '''"""Stub: multi-process tests are out of this suite's scope."""
import unittest


def _skip(*args, **kwargs):
    raise unittest.SkipTest("multi-process test (distributed_testing_utils is not available)")


def run_distributed(*args, **kwargs):
    return lambda fn: _skip


def __getattr__(name):
    return _skip
''',
}
CONFTEST = '''"""Written by hpmoe's benchmarks/transformers_suite.py."""
import json
import os

MARKERS = ("flash_attn_test", "flash_attn_3_test", "torch_compile_test", "torch_export_test",
           "generate", "is_training_test", "is_tensor_parallel_test", "training_ci",
           "bitsandbytes", "not_device_test", "is_staging_test", "is_pipeline_test", "timeout",
           "executorch_export_test", "flash_attn_4_test", "fsdp_test")


def pytest_configure(config):
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


if os.environ.get("HPMOE_SUITE_REPLACE") == "1":
    from transformers import PreTrainedModel

    from hpmoe.nn.families import family_of
    from hpmoe.nn.replace import replace_moe_blocks

    _post_init = PreTrainedModel.post_init
    VIRTUAL_EP = int(os.environ.get("HPMOE_SUITE_VIRTUAL_EP", "2"))
    # "taskflow": every region runs the tile taskflow (schedule None); "auto": the default
    COUNTS = {"models": 0, "regions": 0}  # models built with hpmoe blocks, eager MoE._region calls
    SCHEDULE = {"taskflow": {"schedule": None}, "auto": {}}[os.environ.get("HPMOE_SUITE_PATH", "taskflow")]

    def post_init(self):
        _post_init(self)
        experts = [m.experts.gate_up_proj.shape[0] for m in self.modules() if family_of(m) is not None]
        if experts:  # an EP size must divide the experts (test_load_balancing_loss has 3)
            ep = VIRTUAL_EP if all(e % VIRTUAL_EP == 0 for e in experts) else 1
            replace_moe_blocks(self, virtual_ep=ep, **SCHEDULE)
            COUNTS["models"] += 1

    PreTrainedModel.post_init = post_init

    import torch

    from hpmoe.nn.layer import MoE

    _region = MoE._region

    def counted_region(self, *args, **kwargs):
        if not torch.compiler.is_compiling():  # a counter in a compiled graph makes it recompile
            COUNTS["regions"] += 1
        return _region(self, *args, **kwargs)

    MoE._region = counted_region

    def pytest_sessionfinish(session):
        path = os.environ.get("HPMOE_SUITE_COUNTS")
        if path:
            with open(path, "w") as f:
                json.dump(COUNTS, f)
'''


def _repo_reader(repo: Path, rev: str):
    """A function path -> bytes | None reading a checkout or a (bare) git dir at ``rev``."""
    git_dir = repo if (repo / "objects").is_dir() else repo / ".git"
    if not git_dir.is_dir():
        return lambda p: (repo / p).read_bytes() if (repo / p).is_file() else None

    def read(p: str) -> bytes | None:
        r = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{rev}:{p}"], capture_output=True)
        return r.stdout if r.returncode == 0 else None

    return read


def _sdist_tests(sdist: Path, into: Path) -> Path:
    """The sdist's ``tests`` directory (extracting a .tar.gz under ``into``)."""
    if sdist.is_dir():
        return sdist / "tests"
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    return next(into.glob("transformers-*/tests"))


def assemble(sdist: Path, repo: Path, rev: str, work: Path) -> Path:
    """Build the test tree (plan step 1-2); returns its root."""
    tree = work / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    read = _repo_reader(repo, rev)
    for rel in REPO_FILES:
        data = read(rel)
        if data is None and rel.endswith("__init__.py"):
            data = b""
        if data is None:
            raise SystemExit(f"{rel} is not in {repo} at {rev}")
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    for f in _sdist_tests(sdist, work / "sdist").glob("*.py"):
        shutil.copy(f, tree / "tests" / f.name)
    for rel, text in STUBS.items():
        if not (tree / rel).exists():
            (tree / rel).write_text(text)
    (tree / "conftest.py").write_text(CONFTEST)
    (tree / "src").mkdir()  # test_pipeline_mixin reads src/transformers: the installed package
    (tree / "src" / "transformers").symlink_to(Path(transformers.__file__).parent)
    return tree


def run(tree: Path, replace: bool, virtual_ep: int, path: str, extra: list[str]) -> dict[str, str]:
    """One pytest run; {test id: passed | failed | skipped}."""
    xml = tree / f"junit-{'hpmoe' if replace else 'plain'}.xml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HPMOE_SUITE_REPLACE": "1" if replace else "0", "HPMOE_SUITE_VIRTUAL_EP": str(virtual_ep),
           "HPMOE_SUITE_PATH": path, "HPMOE_SUITE_COUNTS": str(tree / "hpmoe-counts.json"),
           "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    files = [f"tests/models/{m}/test_modeling_{m}.py" for m in MODELS]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree),
           f"--junitxml={xml}", "-o", "junit_family=xunit1", *files, *extra]
    subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    return outcomes(xml)


def outcomes(xml: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(xml).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[name] = ("failed" if kinds & {"failure", "error"}
                        else "skipped" if "skipped" in kinds else "passed")
    return result


def report(plain: dict[str, str], hp: dict[str, str]) -> list[str]:
    """Print the counts and the differences; returns the tests passing only without hpmoe."""
    print(f"{'mode':8s} {'passed':>7s} {'failed':>7s} {'skipped':>8s}")
    for mode, res in (("plain", plain), ("hpmoe", hp)):
        c = Counter(res.values())
        print(f"{mode:8s} {c['passed']:7d} {c['failed']:7d} {c['skipped']:8d}")
    only_plain = sorted(t for t, o in plain.items() if o == "passed" and hp.get(t) != "passed")
    only_hp = sorted(t for t, o in hp.items() if o == "passed" and plain.get(t) != "passed")
    other = sorted(t for t in plain.keys() | hp.keys()
                   if plain.get(t) != hp.get(t) and t not in only_plain and t not in only_hp)
    for title, tests in (("passes only without hpmoe", only_plain), ("passes only with hpmoe", only_hp),
                         ("other differences", other)):
        print(f"\n{title}: {len(tests)}")
        for t in tests:
            print(f"  {t}: plain {plain.get(t, 'absent')}, hpmoe {hp.get(t, 'absent')}")
    return only_plain


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdist", type=Path, required=True, help="transformers sdist (.tar.gz or extracted)")
    p.add_argument("--repo", type=Path, required=True, help="transformers checkout or git dir")
    p.add_argument("--rev", default="HEAD", help="revision of --repo (git only)")
    p.add_argument("--workdir", type=Path, default=None, help="where to build the tree (default: temp)")
    p.add_argument("--virtual-ep", type=int, default=2, help="virtual EP ranks of the hpmoe layers")
    p.add_argument("--path", choices=("taskflow", "auto"), default="taskflow",
                   help="hpmoe regions: always the tile taskflow, or the layers' default (AUTO)")
    p.add_argument("--json", type=Path, default=None, help="write {test: [plain, hpmoe]} here")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = p.parse_args()
    record()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="hpmoe-hfsuite-"))
    tree = assemble(a.sdist, a.repo, a.rev, work)
    plain = run(tree, False, a.virtual_ep, a.path, a.pytest_args)
    hp = run(tree, True, a.virtual_ep, a.path, a.pytest_args)
    only_plain = report(plain, hp)
    counts = json.loads((tree / "hpmoe-counts.json").read_text())
    print(f"\nhpmoe run: {counts['models']} models built with hpmoe blocks, {counts['regions']} region calls")
    if a.json:
        a.json.write_text(json.dumps({t: [plain.get(t), hp.get(t)] for t in sorted(plain.keys() | hp.keys())},
                                     indent=1))
    return 1 if only_plain else 0


if __name__ == "__main__":
    sys.exit(main())
