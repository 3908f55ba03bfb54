"""The package as a user installs it: `pip install --no-build-isolation .` in an environment that has torch
builds the native CPU kernels into the wheel, and they load from the installed package; pip's default
isolated build, where setup.py cannot import torch, stops with the fix instead of installing without them.

Both build from a copy of the files a clone has (tracked and untracked-but-not-ignored: no build outputs,
no virtualenv), offline. The wheel build compiles the extension (its kernels once per ISA): a minute or two on
a 2-core machine.
"""
import csv
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
X86 = platform.machine().lower() in ("x86_64", "amd64")
ISAS = ("avx512", "avx2", "default") if X86 else ("default",)  # the builds inside the extension, best first
VERSION = re.search(r'^__version__ = "([^"]+)"$', (REPO / "mla_ops" / "_version.py").read_text(encoding="utf-8"),
                    re.MULTILINE).group(1)
FIX = "rerun with `pip install --no-build-isolation .`"

pytestmark = pytest.mark.slow


def _environment(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLA_OPS_", "PIP_"))}
    env.update(TORCH_DEVICE_BACKEND_AUTOLOAD="0", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1", **extra)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        env["MAX_JOBS"] = "1"  # one compile job per xdist worker (one per core), as tests run one torch thread
    return env


def _run(args, *, cwd, timeout, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=_environment(**env), capture_output=True, text=True,
                          timeout=timeout)


def _clone_files(dest: pathlib.Path) -> pathlib.Path:
    """Copy what a clone of the repository holds (with the work tree's edits) to `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout ({listed.stderr.decode().strip()}): the files of a clone are unknown")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # (a tracked file deleted in the work tree is not copied)
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def _site_packages(python) -> list[str]:
    """The directories of `python`'s installed packages (where its torch is)."""
    code = "import json, sysconfig; print(json.dumps(sorted({sysconfig.get_path(k) for k in ('purelib', 'platlib')})))"
    return json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout)


def test_readme_install_builds_the_native_kernels_and_they_load(tmp_path):
    source = _clone_files(tmp_path / "clone")
    wheels = tmp_path / "wheels"
    build = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", ".",
                  "-w", wheels], cwd=source, timeout=3600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("mla_ops-*.whl")
    assert wheel.name.startswith(f"mla_ops-{VERSION}-") and not wheel.name.endswith("-none-any.whl"), wheel.name

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        dist_info = f"mla_ops-{VERSION}.dist-info"
        metadata = archive.read(f"{dist_info}/METADATA").decode()
    assert [n for n in names if n.endswith(".so")] == [n for n in names if re.fullmatch(r"mla_ops/_C\.[^/]*\.so", n)]
    assert any(re.fullmatch(r"mla_ops/_C\.[^/]*\.so", n) for n in names), f"no mla_ops/_C in {wheel.name}"
    assert "mla_ops/py.typed" in names
    assert any(n.startswith(dist_info) and n.endswith("/LICENSE") for n in names)
    assert re.search(r"^License(-Expression)?: Apache-2\.0$", metadata, re.MULTILINE), metadata[:2000]
    (torch_requirement,) = re.findall(r"^Requires-Dist: torch\b(.*)$", metadata, re.MULTILINE)
    assert sorted(torch_requirement.strip().split(",")) == ["<2.14", ">=2.13"], torch_requirement

    # A fresh virtualenv that sees this environment's torch (a .pth file: a path it lists is not a site
    # directory, so the development install of mla-ops there stays invisible), the wheel installed by pip.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=300)
    python = venv / "bin" / "python"
    fresh_site = pathlib.Path(_site_packages(python)[0])
    (fresh_site / "torch_from_the_test_environment.pth").write_text(
        "\n".join(_site_packages(sys.executable)) + "\n", encoding="utf-8")
    install = _run([python, "-m", "pip", "install", "--no-deps", "--no-index", wheel], cwd=tmp_path, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    with open(fresh_site / dist_info / "RECORD", newline="") as record:
        installed = [row[0] for row in csv.reader(record) if row]
    assert sum(name.startswith("mla_ops/_C") for name in installed) == 1  # one extension, every ISA inside it
    assert "mla_ops/bench/entry_floor.cpp" in installed  # the benchmark compiles it when it runs

    probe = ("import json, mla_ops\n"
             "from mla_ops import backends\n"
             "from mla_ops.backends import cpu_native\n"
             "print(json.dumps({'file': mla_ops.__file__, 'version': mla_ops.__version__, 'isa': cpu_native.isa(),\n"
             "                  'isas': cpu_native.available_isas(),\n"
             "                  'availability': {name: status for name, _, status in backends.availability_report()},\n"
             "                  'module': cpu_native.load().__file__}))\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    loaded = _run([python, "-c", probe], cwd=outside, timeout=600)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "native CPU kernels are unavailable" not in loaded.stderr, loaded.stderr[-3000:]
    report = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert pathlib.Path(report["file"]).is_relative_to(fresh_site), report["file"]
    assert report["version"] == VERSION
    assert report["availability"]["cpu_native"] == "available", report["availability"]
    assert report["isa"] == report["isas"][0]  # the best build this CPU runs
    assert report["isas"] == [isa for isa in ISAS if isa in report["isas"]] and report["isas"][-1] == "default"
    assert pathlib.Path(report["module"]).is_relative_to(fresh_site), report["module"]


def _setuptools_wheel(dest: pathlib.Path) -> pathlib.Path:
    """The setuptools of this environment as a wheel file, for an offline isolated build (pip installs the
    build requirements into the isolated environment from a wheel)."""
    site = pathlib.Path(sysconfig.get_path("purelib"))
    dist_infos = list(site.glob("setuptools-*.dist-info"))
    if len(dist_infos) != 1:
        pytest.skip(f"setuptools is not installed as one distribution in {site}: {dist_infos}")
    version = dist_infos[0].name[len("setuptools-"):-len(".dist-info")]
    with open(dist_infos[0] / "RECORD", newline="") as record:
        files = [row[0] for row in csv.reader(record) if row]
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"setuptools-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in files:
            if "__pycache__" not in name and not name.endswith(("/INSTALLER", "/REQUESTED", "/direct_url.json")):
                archive.write(site / name, name)
    return wheel


def test_default_isolated_build_stops_with_the_fix(tmp_path):
    """`pip install .` without --no-build-isolation: pip builds in a fresh environment with only the build
    requirements (setuptools), where torch cannot be imported; the build fails and pip shows why."""
    source = _clone_files(tmp_path / "clone")
    find_links = _setuptools_wheel(tmp_path / "build-requirements").parent
    build = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--find-links", find_links, ".",
                  "-w", tmp_path / "wheels"], cwd=source, timeout=900)
    output = build.stdout + build.stderr
    assert build.returncode != 0, output[-3000:]
    assert "mla-ops builds its native CPU kernels against the torch installed in your environment" in output, \
        output[-3000:]
    assert FIX in output and "MLA_OPS_NO_NATIVE=1 for a pure-Python install" in output
    assert not list((tmp_path / "wheels").glob("*.whl"))
