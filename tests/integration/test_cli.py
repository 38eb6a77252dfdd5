"""The command lines a user types: README commands (dry), sweeps, the plan, the tiny maker."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "megatron", "ray", "sglang")


def run_cli(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLMRL_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    cmds = []
    for block in blocks:
        block = re.sub(r"\\\n\s*", " ", block)  # a command continued over lines is one command
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("python -m vlmrl."):
                cmds.append(line)
    return cmds


def dry(cmd: str) -> list[str]:
    """The README command as a dry run: argv after `python`."""
    argv = shlex.split(cmd)[1:]
    if argv[1] == "vlmrl.train" and "--cfg" not in argv and not any(a.startswith("dry_run") for a in argv):
        argv.append("dry_run=true")
    return argv


def test_readme_has_commands():
    cmds = readme_commands()
    assert any("vlmrl.plan" in c for c in cmds) and any("--cfg job" in c for c in cmds)
    assert any(" -m reward=math,geo3k_tol05,geo3k_strict" in c for c in cmds)


# the tiny maker and the parity check run for real in their own tests (below, test_qwen35_parity),
# the real-width maker (a GPU command) on a small vocabulary in test_random_init
@pytest.mark.parametrize("cmd", [c for c in readme_commands()
                                 if not any(m in c for m in ("vlmrl.models.tiny", "vlmrl.parity",
                                                             "vlmrl.models.random_init"))])
def test_readme_command_runs_dry(cmd, tmp_path):
    res = run_cli(dry(cmd), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip()


def test_tiny_maker_command_from_readme(tmp_path):
    cmd = next(c for c in readme_commands() if "vlmrl.models.tiny" in c)
    argv = shlex.split(cmd)[1:]
    out = tmp_path / "tiny"
    argv[argv.index("--out") + 1] = str(out)
    res = run_cli(argv, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
                 "chat_template.jinja", "processor_config.json"):
        assert (out / name).exists(), name
    assert '"model_type": "qwen3_5_moe"' in (out / "config.json").read_text()


def test_dry_run_imports_nothing_heavy(tmp_path):
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['vlmrl.train', '--cfg', 'job', 'experiment=geo3k_qwen35', 'parallel.tp=4', 'hardware=b200']\n"
        "try:\n    runpy.run_module('vlmrl.train', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        f"heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]\n"
        "print('HEAVY', heavy)\n"
    )
    res = run_cli(["-c", probe], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "HEAVY []" in res.stdout
    assert "tp: 4" in res.stdout and "sglang_mm_attention_backend: sdpa" in res.stdout
    assert "${" not in res.stdout  # printed resolved


def test_plan_imports_nothing_heavy(tmp_path):
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['vlmrl.plan', 'experiment=geo3k_qwen35']\n"
        "runpy.run_module('vlmrl.plan', run_name='__main__')\n"
        f"heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]\n"
        "print('HEAVY', heavy)\n"
    )
    res = run_cli(["-c", probe], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "HEAVY []" in res.stdout
    assert "engine 0" in res.stdout and "memory estimate" in res.stdout
    assert not (tmp_path / "runs").exists()  # the plan leaves no run dir behind


def test_sweep_dry_run_gives_three_jobs(tmp_path):
    res = run_cli(["-m", "vlmrl.train", "-m", "reward=math,geo3k_tol05,geo3k_strict", "dry_run=true"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("# dry run")]
    assert len(lines) == 3
    rewards = [re.search(r"reward (\S+);", ln).group(1) for ln in lines]
    assert rewards == ["math", "geo3k_tol05", "geo3k_strict"]
    run_dirs = {re.search(r"run dir (\S+);", ln).group(1) for ln in lines}
    groups = {re.search(r"wandb group (\S+)$", ln).group(1) for ln in lines}
    assert len(run_dirs) == 3 and len(groups) == 3
    # each job's composed config records its own verifier
    for d in run_dirs:
        cfg_text = (Path(d) / ".hydra" / "config.yaml").read_text()
        name = re.search(r"reward:\n  name: (\S+)", cfg_text).group(1)
        assert name in rewards
        tol = re.search(r"  tolerance: (\S+)", cfg_text).group(1)
        assert float(tol) == {"math": 0.0, "geo3k_tol05": 0.05, "geo3k_strict": 0.0}[name]


def test_typo_fails_with_valid_keys(tmp_path):
    res = run_cli(["-m", "vlmrl.train", "rollout.temprature=0.5"], tmp_path)
    assert res.returncode == 2
    assert "Did you mean 'rollout.temperature'" in res.stderr and "Valid keys of rollout" in res.stderr


def test_invalid_config_fails_before_starting(tmp_path):
    res = run_cli(["-m", "vlmrl.train", "experiment=geo3k_qwen35", "parallel.tp=3"], tmp_path)
    assert res.returncode == 2
    assert "[world-size]" in res.stderr and "[tp-heads]" in res.stderr


def test_launch_script_forwards_overrides(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "VLMRL_NUM_GPUS": "8",
           "VLMRL_DATASET_NAME": "/data/geo3k", "VLMRL_CACHE": str(tmp_path / "cache")}
    res = subprocess.run(["bash", str(ROOT / "launch" / "geo3k_qwen35.sh"), "dry_run=true",
                          "logger.project=p1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "path: /data/geo3k" in res.stdout and "project: p1" in res.stdout and "num_gpus: 8" in res.stdout
    env["VLMRL_EXTERNAL_RAY"] = "1"
    env["RAY_ADDRESS"] = "10.0.0.1:6379"
    res = subprocess.run(["bash", str(ROOT / "launch" / "geo3k_qwen35.sh"), "dry_run=true"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "name: external" in res.stdout and "address: 10.0.0.1:6379" in res.stdout
    assert "pkill" not in (ROOT / "launch" / "geo3k_qwen35.sh").read_text()


def test_every_module_entry_answers_help():
    """Every `python -m vlmrl.<module>` (a module with a `__main__` block) answers --help with
    its guide and exit status 0, without a traceback."""
    root = Path(__file__).resolve().parents[2]
    modules = sorted(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__main__")
                     for p in (root / "vlmrl").rglob("*.py") if 'if __name__ == "__main__"' in p.read_text())
    assert len(modules) >= 10 and "vlmrl.train" in modules and "vlmrl.bench" in modules
    for module in modules:
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300,
                             cwd=root)
        text = out.stdout + out.stderr
        assert out.returncode == 0 and "Traceback" not in text, f"{module} --help:\n{text[-2000:]}"
        assert len(out.stdout.strip()) > 80, f"{module} --help printed no guide:\n{text[:500]}"


def test_parity_help_prints_its_guide():
    """`python -m vlmrl.parity --help` prints how to use it (not a Hydra traceback) and starts
    nothing."""
    out = subprocess.run([sys.executable, "-m", "vlmrl.parity", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "python -m vlmrl.parity model=tiny_qwen3_5_moe" in out.stdout and "Traceback" not in out.stderr
