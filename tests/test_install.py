"""A plain (non-editable) install, as Colab's ``pip install <clone>`` makes: the wheel carries the
bundled model, and the installed package finds it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILT_FROM = ("pyproject.toml", "README.md", "focus_jax", "pallas_kernels")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project built into a wheel (from a copy: an in-tree build leaves build/ behind) and
    installed without its dependencies into a folder of its own."""
    pytest.importorskip("setuptools", minversion="77")
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    source.mkdir()
    for name in BUILT_FROM:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # No build isolation: the build uses this environment's setuptools, nothing is downloaded.
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "wheel"),
                    str(source)], check=True, capture_output=True, timeout=300)
    wheels = list((root / "wheel").glob("focus_jax-*.whl"))
    assert len(wheels) == 1
    subprocess.run([*pip, "install", "--no-deps", "--target", str(root / "site"), str(wheels[0])],
                   check=True, capture_output=True, timeout=300)
    return root / "site"


def test_the_wheel_installs_the_bundled_model_and_the_cli_finds_it(installed):
    site = installed.resolve()
    files = {p.name for p in (site / "focus_jax" / "bundled" / "focus-tiny").iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json",
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= files
    # The installed package (first on the path; run outside the repository) resolves its default
    # model inside the install and loads it; --help names that folder.
    probe = ("import contextlib\n"
             "from focus_jax import cli\n"
             "m = cli.load_model(None)\n"
             "print(cli.BUNDLED_MODEL, m.config.num_layers, m.tokenizer is not None)\n"
             "with contextlib.suppress(SystemExit):\n"
             "    cli.main(['generate', '--help'])\n")
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=installed.parent, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    bundled = site / "focus_jax" / "bundled" / "focus-tiny"
    assert done.stdout.splitlines()[0] == f"{bundled} 8 True"
    help_text = "".join(done.stdout.split("\n", 1)[1].split())  # argparse wraps at hyphens too
    assert f"default:{bundled})" in help_text


def test_a_missing_bundled_model_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    from focus_jax import cli

    monkeypatch.setattr(cli, "BUNDLED_MODEL", tmp_path / "focus-tiny")
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bundled model is missing" in err and "--model" in err
