"""Launching: `miniddp launch script.py` like `accelerate launch`, YAML -> torchrun, SLURM node ranks,
one-line errors, and real runs: a user script on 2 processes, two nodes on loopback."""

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from miniddp import TrainingConfig
from miniddp.launching.accelerate_config import read_config
from miniddp.launching.launch import main, split_argv
from miniddp.launching.notebook import notebook_launcher
from miniddp.launching.torchrun_args import torchrun_args, train_flags

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
MINIDDP = Path(sys.executable).parent / "miniddp"  # the installed console script, beside this python
TWO = {"num_machines": 2, "num_processes": 16, "machine_rank": 0, "main_process_ip": "10.0.0.1",
       "main_process_port": 29500, "same_network": True}


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


# --- the YAML -> torchrun arguments ---------------------------------------------------------------

def test_example_yamls_are_valid():
    one, two = read_config(EXAMPLES / "one_machine.yaml"), read_config(EXAMPLES / "two_machines.yaml")
    assert torchrun_args(one, environ={}) == ["--standalone", "--nproc-per-node=2"]
    assert torchrun_args(two, environ={}) == ["--nnodes=2", "--nproc-per-node=8", "--node-rank=0",
                                              "--master-addr=10.0.0.1", "--master-port=29500"]


def test_num_processes_is_the_total_over_machines():
    assert "--nproc-per-node=8" in torchrun_args(TWO, environ={})


def test_slurm_node_rank_overrides_the_fixed_machine_rank():
    # the pitfall: every node reads machine_rank: 0 from the same YAML
    env = {"SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    args = torchrun_args({**TWO, "main_process_ip": None}, environ=env)
    assert "--node-rank=1" in args and "--master-addr=gpu07" in args


def test_machine_rank_flag_wins_over_everything():
    assert "--node-rank=1" in torchrun_args(TWO, environ={"SLURM_NODEID": "0"}, machine_rank=1)


def test_c10d_rendezvous_when_not_on_the_same_network():
    args = torchrun_args({**TWO, "same_network": False}, environ={})
    assert "--rdzv-backend=c10d" in args and "--rdzv-endpoint=10.0.0.1:29500" in args


@pytest.mark.parametrize("cfg, message", [
    ({**TWO, "num_processes": 15}, "multiple of num_machines"),
    ({**TWO, "machine_rank": 2}, "machine_rank 2 must be < num_machines"),
    ({**TWO, "num_processes": 2 * 2**22 + 2}, "PID_MAX_LIMIT"),  # more per machine than Linux can hold
    ({**TWO, "main_process_ip": None}, "main_process_ip"),
])
def test_bad_configs_are_explained(cfg, message):
    with pytest.raises(ValueError, match=message):
        torchrun_args(cfg, environ={})


def test_yaml_mixed_precision_and_cpu_reach_the_trainer_unless_overridden():
    assert train_flags({"mixed_precision": "bf16", "use_cpu": True}, ["--output_dir", "x"]) == [
        "--output_dir", "x", "--mixed_precision", "bf16", "--use_cpu", "true"]
    assert train_flags({"mixed_precision": "bf16"}, ["--mixed_precision", "no"]) == ["--mixed_precision", "no"]
    assert train_flags({"use_cpu": True}, ["--use_cpu=false"]) == ["--use_cpu=false"]


# --- the command line: what belongs to the launcher, what to the script --------------------------

def test_everything_after_the_script_or_module_is_the_scripts():
    assert split_argv(["--num_processes", "2", "s.py", "--num_processes", "5", "-m", "x", "--", "--dry_run"]) == (
        ["--num_processes", "2"], ["s.py"], ["--num_processes", "5", "-m", "x", "--", "--dry_run"])
    assert split_argv(["--config_file=f.yaml", "-m", "miniddp.train", "--output_dir", "o", "s.py"]) == (
        ["--config_file=f.yaml"], ["-m", "miniddp.train"], ["--output_dir", "o", "s.py"])
    assert split_argv(["--dry_run"]) == (["--dry_run"], [], [])


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


def _dry_run(capsys, *argv):
    assert main(["launch", "--dry_run", *argv]) == 0
    out, err = capsys.readouterr()
    return out.strip(), err.strip()


def test_dry_run_passes_script_arguments_through_untouched(capsys, script):
    out, err = _dry_run(capsys, "--num_processes", "3", script, "--num_processes", "5", "--lr", "1e-3")
    assert out == ("MINIDDP_MIXED_PRECISION=no MINIDDP_USE_CPU=false torchrun --standalone --nproc-per-node=3 "
                   f"{script} --num_processes 5 --lr 1e-3")
    assert err == ""  # the count was given: nothing to explain


def test_without_a_count_one_process_per_gpu_else_two_on_the_cpu(capsys, script, monkeypatch):
    gpus = torch.cuda.device_count()
    out, err = _dry_run(capsys, script)
    assert f"--nproc-per-node={gpus or 2} " in out
    assert err == (f"miniddp launch: {gpus} process{'es' * (gpus > 1)}, one per visible GPU "
                   f"(torch.cuda.device_count() = {gpus}); --num_processes N to choose" if gpus else
                   "miniddp launch: 2 processes on the CPU: no GPU is visible; --num_processes N to choose")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    out, err = _dry_run(capsys, script)
    assert "--nproc-per-node=4 " in out
    assert err == "miniddp launch: 4 processes, one per visible GPU (torch.cuda.device_count() = 4); " \
                  "--num_processes N to choose"


def test_the_yaml_reaches_miniddp_train_as_flags_and_other_scripts_as_environment(capsys, script):
    two = ["--config_file", str(EXAMPLES / "two_machines.yaml"), "--machine_rank", "1"]
    out, _ = _dry_run(capsys, *two, "-m", "miniddp.train", "--output_dir", "o")
    assert out == ("MINIDDP_MIXED_PRECISION=bf16 MINIDDP_USE_CPU=false torchrun --nnodes=2 --nproc-per-node=8 "
                   "--node-rank=1 --master-addr=10.0.0.1 --master-port=29500 "
                   "-m miniddp.train --output_dir o --mixed_precision bf16")
    out, _ = _dry_run(capsys, *two, script, "--output_dir", "o")
    assert out.startswith("MINIDDP_MIXED_PRECISION=bf16 ") and out.endswith(f"{script} --output_dir o")


def test_the_count_flag_overrides_the_yaml(capsys, script):
    out, _ = _dry_run(capsys, "--config_file", str(EXAMPLES / "one_machine.yaml"), "--num_processes", "4", script)
    assert "MINIDDP_USE_CPU=true torchrun --standalone --nproc-per-node=4 " in out


# --- bad input: one line naming the key and the fix, status 2, never a traceback ---------------------

DS = "config: it needs `accelerate launch`; miniddp runs DDP, ZeRO and FSDP only"
BAD = {  # case: (YAML file or None, launcher arguments, the one line after "miniddp launch: error: ")
    "malformed YAML": ("num_processes: [2\n", ["script.py"],
                       "bad.yaml: not valid YAML at line 2, column 1 (expected ',' or ']', but got '<stream end>'); "
                       "an accelerate config is one `key: value` per line"),
    "num_processes: 2.9": ("num_processes: 2.9\n", ["script.py"],
                           "bad.yaml: num_processes: 2.9 must be a whole number >= 1: set it to the total number of "
                           "processes over all machines, e.g. `num_processes: 2`"),
    "num_processes: true": ("num_processes: true\n", ["script.py"],
                            "bad.yaml: num_processes: true must be a whole number >= 1: set it to the total number of "
                            "processes over all machines, e.g. `num_processes: 2`"),
    "num_machines: two": ('num_machines: "two"\n', ["script.py"],
                          'bad.yaml: num_machines: "two" must be a whole number >= 1: set it to the number of '
                          "machines, e.g. `num_machines: 1`"),
    "port 70000": ("num_machines: 2\nnum_processes: 4\nmain_process_ip: 10.0.0.1\nmain_process_port: 70000\n",
                   ["script.py"], "bad.yaml: main_process_port: 70000 must be a whole number in 1..65535: set it to "
                                  "a free TCP port on machine 0, e.g. `main_process_port: 29500`"),
    "port 0": ("main_process_port: 0\n", ["script.py"],
               "bad.yaml: main_process_port: 0 must be a whole number in 1..65535: set it to a free TCP port on "
               "machine 0, e.g. `main_process_port: 29500`"),
    "--num_processes -1": (None, ["--num_processes", "-1", "script.py"],
                           "argument --num_processes: -1 must be a whole number >= 1: give the total over all "
                           "machines, e.g. --num_processes 2"),
    "zero_stage: 4": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n", ["script.py"],
                      "bad.yaml: deepspeed_config.zero_stage: 4: miniddp runs ZeRO stage 0, 1, 2 or 3"),
    "fsdp_config": ("fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n", ["script.py"],
                    "bad.yaml: fsdp_config is read with `distributed_type: FSDP` only: set it, or delete the block"),
    "FSDP offload": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_offload_params: true\n", ["script.py"],
                     "bad.yaml: fsdp_config: fsdp_offload_params=true: offloading is not implemented in miniddp (the "
                     "shards stay on the device): set it false or delete it"),
    "megatron_lm_config": ("megatron_lm_config:\n  megatron_lm_tp_degree: 2\n", ["script.py"],
                           f"bad.yaml: this is a Megatron-LM {DS}"),
    "MEGATRON_LM": ("distributed_type: MEGATRON_LM\n", ["script.py"], f"bad.yaml: this is a Megatron-LM {DS}"),
    "no such script": (None, ["no_such_script.py", "--output_dir", "o"],
                       "no such script: no_such_script.py (paths are relative to {cwd})"),
}


REAL_COMMAND = ("malformed YAML", "no such script")  # through the installed command: "no traceback", for real


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_status_2(tmp_path, case, monkeypatch, capsys):
    text, argv, message = BAD[case]
    (tmp_path / "script.py").write_text("print('hello')\n")
    if text is not None:
        (tmp_path / "bad.yaml").write_text(text)
        argv = ["--config_file", "bad.yaml", *argv]
    if case in REAL_COMMAND:
        done = subprocess.run([str(MINIDDP), "launch", *argv], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=60)
        status, out, err = done.returncode, done.stdout, done.stderr
    else:  # the same main() in this process: a new interpreter importing torch per case costs seconds each
        monkeypatch.chdir(tmp_path)
        status = main(["launch", *argv])
        out, err = capsys.readouterr()
    assert (status, out) == (2, ""), err
    assert err == f"miniddp launch: error: {message.format(cwd=tmp_path.resolve())}\n"


@pytest.mark.parametrize("argv, message", [
    (["--config_file", "f.yaml", "--", "--output_dir", "o"], "`--` is not used"),  # the old syntax
    (["--num_proc", "2", "s.py"], "unknown option --num_proc"),
    (["-m"], "-m needs a module name"),
    (["-m", "no_such_package.train"], "no module named no_such_package.train"),
    (["--num_processes", "2"], "name the script to run"),
    (["--config_file", "missing.yaml", "{script}"], "--config_file missing.yaml: No such file"),
    (["--machine_rank", "1", "{script}"], "--machine_rank 1 must be < num_machines (1)"),
    (["--config_file", "{yaml:mixed_precision: fp8}", "{script}"], "mixed_precision: \"fp8\": miniddp supports"),
    (["--config_file", "{yaml:use_cpu: 'yes'}", "{script}"], 'use_cpu: "yes" must be true or false'),
    (["--config_file", "{yaml:num_procs: 2}", "{script}"], "unknown key(s) ['num_procs']"),
])
def test_more_bad_input_in_process(tmp_path, script, capsys, argv, message):
    def fill(word):
        if word.startswith("{yaml:"):
            (tmp_path / "c.yaml").write_text(word[6:-1] + "\n")
            return str(tmp_path / "c.yaml")
        return script if word == "{script}" else word
    assert main(["launch", *map(fill, argv)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and message in err, err


BOMB = "&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"  # a billion laughs: 9**8 values in 353 bytes
for _i in range(1, 8):
    BOMB = f"&l{_i} [{BOMB}" + f", *l{_i - 1}" * 8 + "]"


@pytest.mark.parametrize("argv, field", [  # each ended in a traceback, a hang, a silent skip, or a run
    (["--config_file", "{yaml:machine_rank: 5}", "--dry_run", "{script}"], "machine_rank"),  # ignored on one machine
    (["--num_processes", "\u0662", "--dry_run", "{script}"], "--num_processes"),  # int() reads Arabic-Indic digits
    (["--num_processes", "99999999999999999999", "--dry_run", "{script}"], "--num_processes"),
    (["--config_file", "{yaml:num_processes: 99999999999999999999}", "--dry_run", "{script}"], "num_processes"),
    (["--config_file", "{yaml:num_processes: 2024-01-01}", "{script}"], "num_processes"),  # a date: TypeError
    (["--config_file", "{yaml:mixed_precision: !!binary aGk=}", "{script}"], "mixed_precision"),  # bytes
    (["--config_file", "{yaml:num_machines: 2\nnum_processes: 2\nmain_process_ip: \"1.2.3.\\udcff\"}",
      "--dry_run", "{script}"], "main_process_ip"),  # a byte that was not UTF-8: torchrun's 31-line ValueError
    (["--config_file", "{yaml:gpu_ids: \"\u0662\"}", "--dry_run", "{script}"], "gpu_ids"),
    (["--config_file", "{yaml:1: 2\nnum_procs: 2}", "{script}"], "line 1"),  # unknown keys sorted: TypeError
    (["--config_file", "{yaml:? [a, b]\n: 1}", "{script}"], "line 1"),  # an unhashable key: TypeError
    (["--config_file", "{yaml:distributed_type: [a]}", "{script}"], "distributed_type"),  # TypeError
    (["--config_file", "{yaml:compute_environment: AMAZON_SAGEMAKER}", "--dry_run", "{script}"],
     "compute_environment"),  # run here as if local
    (["--config_file", "{yaml:num_processes: " + BOMB + "}", "{script}"], "line 1"),  # 9**8 values spelt out
    (["--config_file", "{yaml:num_processes: 2\n" + "#" * 2**21 + "}", "--dry_run", "{script}"], "c.yaml"),
])
def test_values_that_ended_later_are_refused_in_one_line(tmp_path, script, capsys, argv, field):
    def fill(word):
        if word.startswith("{yaml:"):
            (tmp_path / "c.yaml").write_text(word[6:-1] + "\n", encoding="utf-8")
            return str(tmp_path / "c.yaml")
        return script if word == "{script}" else word
    assert main(["launch", *map(fill, argv)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and field in err and len(err) < 500, err[:500]
    if "{yaml:" in argv[1]:
        assert str(tmp_path / "c.yaml") in err  # the file is named


def test_a_machine_rank_out_of_range_is_refused_alike_from_the_yaml_and_the_flag(tmp_path, script, capsys):
    (tmp_path / "c.yaml").write_text("num_machines: 1\nmachine_rank: 5\n")
    said = []
    for argv in (["--config_file", str(tmp_path / "c.yaml")], ["--machine_rank", "3"]):
        assert main(["launch", "--dry_run", *argv, script]) == 2  # before: the YAML's was ignored
        said.append(capsys.readouterr().err)
    assert str(tmp_path / "c.yaml") in said[0]
    for err, given in zip(said, ("machine_rank: 5", "--machine_rank 3")):
        assert len(err.splitlines()) == 1 and f"{given} must be < num_machines (1" in err, err


def test_a_slurm_node_id_that_is_no_number_is_named(capsys, script, monkeypatch):
    (Path(script).parent / "two.yaml").write_text(yaml.safe_dump(TWO))
    monkeypatch.setenv("SLURM_NODEID", "\u0661")  # int() reads it as 1
    assert main(["launch", "--dry_run", "--config_file", str(Path(script).parent / "two.yaml"), script]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "SLURM_NODEID" in err, err


def test_a_default_config_path_that_is_a_directory_is_refused(tmp_path, script, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "hf" / "accelerate" / "default_config.yaml").mkdir(parents=True)
    assert main(["launch", "--dry_run", script]) == 2  # before: skipped without a word, the job run without it
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(tmp_path / "hf" / "accelerate" / "default_config.yaml") in err, err


@pytest.mark.parametrize("more", [0, 1])
def test_more_processes_than_cpu_cores_is_warned_about_not_refused(tmp_path, script, capsys, monkeypatch, more):
    import torch.distributed.run

    from miniddp.launching.launch_checks import cpu_cores

    started = []
    monkeypatch.setattr(torch.distributed.run, "main", started.append)  # torchrun itself is not run
    for name in ("MINIDDP_MIXED_PRECISION", "MINIDDP_USE_CPU"):  # the launcher sets them in this process
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "cpu.yaml").write_text("distributed_type: MULTI_CPU\nuse_cpu: true\n")
    count = cpu_cores() + more
    assert main(["launch", "--config_file", str(tmp_path / "cpu.yaml"), "--num_processes", str(count), script]) == 0
    assert f"--nproc-per-node={count}" in started[0]
    said = capsys.readouterr().err.splitlines()
    assert len(said) == more and all(str(count) in line and str(cpu_cores()) in line for line in said), said


def test_an_unquoted_no_is_read_as_mixed_precision_no(tmp_path):
    (tmp_path / "c.yaml").write_text("mixed_precision: no\n")  # YAML 1.1 reads `no` as false
    assert read_config(tmp_path / "c.yaml")["mixed_precision"] == "no"


# --- real runs: a user's script on 2 processes ----------------------------------------------------

REPORT = """\
import json, os, sys
rank = os.environ["RANK"]
seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MINIDDP_MIXED_PRECISION", "MINIDDP_USE_CPU")}
with open(f"rank{rank}.json", "w") as f:
    json.dump({**seen, "argv": sys.argv[1:]}, f)
sys.exit(3 if os.environ.get("EXIT_3_ON_RANK") == rank else 0)
"""


def _launch(tmp_path, *argv, **env):
    (tmp_path / "report.py").write_text(REPORT)
    done = subprocess.run([str(MINIDDP), "launch", *argv], cwd=tmp_path, env=_env(**env), capture_output=True,
                          text=True, timeout=120)
    ranks = [json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")]
    return done, sorted(ranks, key=lambda seen: int(seen["RANK"]))


@pytest.mark.timeout(180)
def test_a_script_runs_on_two_processes_with_its_arguments_and_the_yaml_settings(tmp_path):
    (tmp_path / "cpu.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\n"
                                       "use_cpu: true\n")
    args = ["--num_processes", "5", "--config_file", "x.yaml", "-m", "not.a.module", "--dry_run", "--", "two words"]
    done, ranks = _launch(tmp_path, "--config_file", "cpu.yaml", "report.py", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ranks == [{"RANK": str(r), "WORLD_SIZE": "2", "MINIDDP_MIXED_PRECISION": "bf16", "MINIDDP_USE_CPU": "true",
                      "argv": args} for r in range(2)]


@pytest.mark.timeout(180)
def test_a_module_runs_with_the_default_count(tmp_path):
    done, ranks = _launch(tmp_path, "-m", "report", "--output_dir", "o")  # cwd holds report.py, as `python -m`
    assert done.returncode == 0, done.stderr[-3000:]
    count = torch.cuda.device_count() or 2
    assert [r["RANK"] for r in ranks] == [str(r) for r in range(count)] and ranks[0]["WORLD_SIZE"] == str(count)
    assert ranks[0]["argv"] == ["--output_dir", "o"]
    assert (ranks[0]["MINIDDP_MIXED_PRECISION"], ranks[0]["MINIDDP_USE_CPU"]) == ("no", "false")  # no config file
    assert done.stderr.startswith(f"miniddp launch: {count} process")


@pytest.mark.timeout(180)
def test_a_failing_rank_fails_the_launch_with_its_exit_status(tmp_path):
    done, ranks = _launch(tmp_path, "--num_processes", "2", "report.py", EXIT_3_ON_RANK="1")
    # rank 1 exits 3 after writing its report; torchrun may stop rank 0 before it writes its own
    assert done.returncode == 3 and "1" in {r["RANK"] for r in ranks}
    assert "report.py FAILED" in done.stderr and "Traceback" not in done.stderr  # torchrun's summary, not ours


# --- real runs: two nodes on loopback, the training CLI ---------------------------------------------

def _free_port() -> int:
    """A free port below Linux's ephemeral range (32768+), where the OS places every port-0
    store and gloo connection of the tests running in parallel: none of them can take it
    between our check and torchrun's bind."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


TRAIN = ["--max_steps", "6", "--dataset_size", "256", "--eval_size", "64", "--disable_tqdm", "true",
         "--per_device_train_batch_size", "8", "--logging_steps", "3"]


@pytest.mark.timeout(300)
def test_two_nodes_on_loopback_equal_one_node_with_four_processes(tmp_path):
    from miniddp.testing.netlab import unavailable  # two real hosts as network namespaces

    if unavailable(shaping=False) is None:  # the same two-machine YAML across two real hosts: test_two_hosts.py
        pytest.skip("covered across two network namespaces by tests/test_two_hosts.py")
    cfg = {"distributed_type": "MULTI_CPU", "num_machines": 2, "num_processes": 4, "machine_rank": 0,
           "main_process_ip": "127.0.0.1", "main_process_port": _free_port(), "use_cpu": True}
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(cfg))
    # output goes to files, not pipes: a pipe nobody reads fills up and blocks its node mid-training
    logs = [open(tmp_path / f"node{r}.log", "w+") for r in range(2)]
    nodes = [subprocess.Popen([str(MINIDDP), "launch", "--config_file", str(tmp_path / "two.yaml"),
                               "--machine_rank", str(r), "-m", "miniddp.train",
                               "--output_dir", str(tmp_path / "two"), *TRAIN],
                              env=_env(), stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(2)]
    try:
        for n in nodes:
            n.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pass  # reported below, with both nodes' output
    finally:
        for n in nodes:
            n.kill()
            n.wait()
    outputs = [(tmp_path / f"node{r}.log").read_text() for r in range(2)]
    assert all(n.returncode == 0 for n in nodes), f"node 0:\n{outputs[0][-3000:]}\nnode 1:\n{outputs[1][-3000:]}"
    single = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                             "-m", "miniddp.train", "--output_dir", str(tmp_path / "one"), *TRAIN],
                            env=_env(), capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    a = torch.load(tmp_path / "two" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "one" / "final_model.pt", weights_only=True)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    metrics = yaml.safe_load((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["effective_batch_size"] == 32


def _notebook_job(config):
    from miniddp import Trainer
    from miniddp.training.tasks import make_task

    return Trainer(args=config, **make_task(config)).train()["global_step"]


def test_notebook_launcher_trains_on_two_ranks(tmp_path):
    cfg = TrainingConfig(output_dir=str(tmp_path), max_steps=3, dataset_size=64, eval_size=0, disable_tqdm=True)
    assert notebook_launcher(_notebook_job, (cfg,), num_processes=2, timeout=120) == [3, 3]
