"""`pip install --no-build-isolation .`, the README's install line, into a fresh virtualenv:
the package builds (the library and the CLI only), every Python module is installed, and the
installed package trains from outside the source tree.

The fresh venv sees the project venv's packages through a .pth file, standing in for pip's
cache: torch and its CUDA libraries are 5 GB, and downloading them again would double the
suite's install time. What is tested is conveyor's own packaging: its build finds torch and
UCX with no help from ./run, its build requirements are declared, and nothing is left out.

The build goes to <root>/build-pip, beside ./build at the same depth, so ccache serves the
objects ./build compiled and the build takes about a minute after ./run build (docs/design.md,
"Packaging")."""
import os
import pathlib
import subprocess
import sys
import sysconfig
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "conveyor"

TRAIN_TWO_STEPS = """
import torch, conveyor
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
model = conveyor.Module(net, opt, loss_fn=torch.nn.functional.mse_loss, verbose=False)
x, y = torch.randn(8, 8), torch.randn(8, 1)
for _ in range(2):
    opt.zero_grad()
    loss = model(x, target=y)
    loss.backward()
    opt.step()
print("package", conveyor.__file__)
print("loss", float(loss))
"""


def test_build_requirements_are_declared():
    requires = " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"])
    for name in ("meson-python", "meson", "ninja", "torch", "libucx-cu13"):
        assert name in requires, f"pyproject.toml's build requirements lack {name}"


@pytest.mark.skipif(not os.environ.get("CONVEYOR_BUILD_DIR"), reason="needs ./run's build (ccache makes it quick)")
def test_pip_install_into_a_fresh_venv_trains(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (pathlib.Path(site) / "project_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CONVEYOR_ROOT", "CONVEYOR_BUILD_DIR", "PKG_CONFIG_PATH")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    build = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-build-isolation",
         "-Cbuild-dir=build-pip", str(ROOT)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]

    installed = pathlib.Path(site) / "conveyor"
    sources = {p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")}
    missing = sorted(str(p) for p in sources if not (installed / p).is_file())
    assert not missing, f"bindings/conveyor/meson.build does not install {missing}"
    ninja = (ROOT / "build-pip" / "build.ninja").read_text()
    assert "tests/" not in ninja and "bench/" not in ninja, "pip install builds tests or benchmarks"

    run = subprocess.run([python, "-c", TRAIN_TWO_STEPS], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert f"package {installed / '__init__.py'}" in run.stdout, run.stdout
    loss = float(run.stdout.split("loss ")[1])
    assert loss == loss and loss > 0

    cli = subprocess.run([venv / "bin" / "conveyor", "--help"], env=env, capture_output=True, text=True)
    assert cli.returncode == 0 and "plan" in cli.stdout, cli.stdout + cli.stderr
