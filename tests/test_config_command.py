"""`miniddp config`, `miniddp env`, and `miniddp launch` reading Accelerate's default config file.

The questionnaire runs in a real pseudo-terminal: answers are typed, wrong ones among them, and
each wrong one must be explained and asked again. The file it writes is read back by miniddp's
launcher and by Accelerate's own loader (skipped, with the reason, without Accelerate). The other bad
answers and places are fed to the questionnaire in this process, through ``input``.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miniddp import TrainingConfig
from miniddp.launching.accelerate_config import default_config_file, read_config
from miniddp.launching.config_command import main as config_main
from miniddp.launching.env_command import report
from miniddp.zero.deepspeed_config import accelerate_variables

MINIDDP = [sys.executable, "-m", "miniddp.__main__"]


def _typed(argv, answers, env, timeout=60.0) -> str:
    """Run ``argv`` in a pseudo-terminal; at each prompt (output ending in ': ' or '? '), type the next answer
    (``answers=None``: a command that asks nothing, never answered). Returns everything the terminal showed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, its stdin and stdout the terminal
        os.execvpe(argv[0], argv, env)
    shown, pending = b"", list(answers or [])
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError(f"no prompt within {timeout} s; the terminal shows:\n{shown.decode()}")
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal: it has exited
                break
            if not chunk:
                break
            shown += chunk
            if answers is not None and shown.rstrip(b" ").endswith((b":", b"?")) and shown.endswith(b" "):
                if not pending:
                    raise AssertionError(f"asked more than was answered:\n{shown.decode()}")
                os.write(fd, pending.pop(0).encode() + b"\n")
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, shown.decode()
    assert not pending, f"not asked for {pending}:\n{shown.decode()}"
    return shown.decode()


def test_the_questionnaire_asks_again_after_a_wrong_answer_and_writes_what_launch_reads(tmp_path):
    path = tmp_path / "two-machines.yaml"
    answers = ["", "x", "1",  # this machine; "x" is no option: asked again; multi-CPU
               "two", "2",  # the number of machines, the second time in digits
               "5", "1",  # this machine's rank: 5 is out of range for 2 machines
               "", "10.0.0.1",  # the main process's IP has no default
               "",  # its port: the default
               "",  # DeepSpeed: no (the default)
               "",  # FSDP: no (the default)
               "",  # processes: the default (one per machine)
               "3", "2"]  # mixed precision: 3 is no option; bf16
    shown = _typed([*MINIDDP, "config", "--config_file", str(path)], answers, {**os.environ, "HF_HOME": str(tmp_path)})
    assert shown.count("try again") == 5
    assert "[29500]" in shown and "[1]" in shown
    cfg = read_config(path)
    assert {k: cfg[k] for k in ("distributed_type", "num_machines", "machine_rank", "main_process_ip",
                                "main_process_port", "num_processes", "use_cpu", "mixed_precision")} == {
        "distributed_type": "MULTI_CPU", "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1",
        "main_process_port": 29500, "num_processes": 2, "use_cpu": True, "mixed_precision": "bf16"}
    accelerate = pytest.importorskip("accelerate.commands.config.config_args", reason="accelerate is not installed")
    theirs = accelerate.load_config_from_file(str(path))
    assert (theirs.distributed_type.value, theirs.num_machines, theirs.machine_rank, theirs.mixed_precision) == (
        "MULTI_CPU", 2, 1, "bf16")


def test_deepspeed_answers_write_the_block_that_accelerate_launch_and_miniddp_launch_read_alike(tmp_path):
    path = tmp_path / "zero.yaml"
    answers = ["", "1", "",  # this machine, multi-CPU, one machine
               "maybe", "y",  # DeepSpeed: "maybe" is no answer; yes
               "",  # no DeepSpeed JSON: the questions
               "4", "",  # the stage: 4 is no option; Enter takes 2
               "0", "4",  # accumulation steps: at least 1
               "yes", "-1", "0.5",  # clipping: a negative value refused
               "2",  # processes
               "1", "2"]  # mixed precision: fp16 refused with ZeRO stage 2; bf16
    shown = _typed([*MINIDDP, "config", "--config_file", str(path)], answers, {**os.environ, "HF_HOME": str(tmp_path)})
    assert shown.count("try again") == 5, shown
    cfg = read_config(path)
    assert (cfg["distributed_type"], cfg["num_processes"], cfg["mixed_precision"]) == ("DEEPSPEED", 2, "bf16")
    assert cfg["deepspeed_config"] == {"zero_stage": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
                                       "zero3_init_flag": False}
    ours = accelerate_variables(cfg["deepspeed_config"], str(path))
    dry = subprocess.run([*MINIDDP, "launch", "--config_file", str(path), "--dry_run", "-m", "miniddp.train",
                          "--output_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert all(f"{name}={value}" in dry.stdout.split() for name, value in ours.items()), dry.stdout
    assert dry.stdout.split(" -m miniddp.train ")[1].split()[-4:] == ["--gradient_accumulation_steps", "4",
                                                                     "--max_grad_norm", "0.5"]
    commands = pytest.importorskip("accelerate.commands.launch", reason="accelerate is not installed")
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, defaults, _ = commands._validate_launch_command(  # Accelerate's own launcher, on the same file
        commands.launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    theirs = prepare_deepspeed_cmd_env(args)[1]
    assert ours == {k: v for k, v in theirs.items() if k in ours} and ours["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"


def test_a_deepspeed_json_is_checked_when_it_is_named_and_asked_again(tmp_path, monkeypatch, capsys):
    (tmp_path / "stage3.json").write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}')
    fp16 = '{"fp16": {"enabled": true}, "zero_optimization": {"stage": 2}}'  # what the hand path refuses
    (tmp_path / "fp16.json").write_text(fp16)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": "auto"}')
    path = tmp_path / "json.yaml"
    monkeypatch.chdir(tmp_path)
    pending = _answer(monkeypatch, ["", "1", "", "y", "y",  # multi-CPU, DeepSpeed with a JSON
                                    str(tmp_path / "none.json"), "stage3.json",  # missing; offloading
                                    "fp16.json", "ds.json",  # fp16 with ZeRO stage 2; good
                                    "2"])  # processes; mixed precision is the JSON's, not asked
    assert config_main(["--config_file", str(path)]) == 0 and not pending
    shown = capsys.readouterr().out
    assert shown.count("try again") == 3 and "offload_param" in shown and "fp16.enabled" in shown, shown
    for precision in ("no", "fp16"):  # the trainer refuses that file whatever its flag says: so does the question
        with pytest.raises(ValueError):
            TrainingConfig(deepspeed=fp16, mixed_precision=precision)
    cfg = read_config(path)
    assert cfg["deepspeed_config"] == {"deepspeed_config_file": str(tmp_path / "ds.json"), "zero3_init_flag": False}
    assert "mixed_precision" not in yaml.safe_load(path.read_text())  # as Accelerate writes it: the JSON says


def test_default_writes_where_accelerate_looks_never_overwrites_and_launch_reads_it(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    expected = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    done = subprocess.run([*MINIDDP, "config", "--default", "--mixed_precision", "fp16"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and str(expected) in done.stdout
    written = yaml.safe_load(expected.read_text())
    assert written["mixed_precision"] == "fp16" and written["num_processes"] == 1
    again = subprocess.run([*MINIDDP, "config", "--default"], env=env, capture_output=True, text=True)
    assert again.returncode == 1 and yaml.safe_load(expected.read_text()) == written  # not overwritten
    # launch with no --config_file: the default file, named
    written["num_processes"], written["distributed_type"] = 3, "MULTI_CPU"
    expected.write_text(yaml.safe_dump(written))
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    dry = subprocess.run([*MINIDDP, "launch", "--dry_run", str(script)], env=env, capture_output=True, text=True)
    assert dry.returncode == 0 and str(expected) in dry.stderr
    assert "ignoring" not in dry.stderr  # Accelerate's `main_training_function: main` is its default, no setting
    assert "--nproc-per-node=3" in dry.stdout.split(), dry.stdout
    # without the file, no notice
    expected.unlink()
    plain = subprocess.run([*MINIDDP, "launch", "--dry_run", str(script)], env=env, capture_output=True, text=True)
    assert plain.returncode == 0 and "default_config.yaml" not in plain.stderr


def test_default_config_file_honours_accelerates_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_config_file() == str(tmp_path / "xdg" / "huggingface" / "accelerate" / "default_config.yaml")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert default_config_file() == str(tmp_path / "hf" / "accelerate" / "default_config.yaml")


def test_a_file_from_the_real_accelerate_config_default_is_read_and_launched(tmp_path):
    accelerate = Path(sys.executable).parent / "accelerate"  # the console script of the hf extra
    if not accelerate.exists():
        pytest.skip("accelerate is not installed: pip install -e '.[hf]'")
    real = tmp_path / "accelerate-default.yaml"
    made = subprocess.run([str(accelerate), "config", "default", "--config_file", str(real)], capture_output=True,
                          text=True)
    assert made.returncode == 0, made.stderr
    cfg = read_config(real)  # Accelerate writes JSON here, which is YAML too
    assert cfg["compute_environment"] == "LOCAL_MACHINE" and cfg["mixed_precision"] == "no"
    launched = subprocess.run([*MINIDDP, "launch", "--config_file", str(real), "--dry_run", "-m", "miniddp.train",
                               "--output_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert launched.returncode == 0, launched.stderr
    assert f"--nproc-per-node={cfg['num_processes']}" in launched.stdout


def test_env_names_the_versions_backends_and_the_config_in_use(tmp_path):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n")
    shown = _typed([*MINIDDP, "env", "--config_file", str(cfg)], None, dict(os.environ))  # in a terminal, as typed
    assert "PyTorch version" in shown and "gloo" in shown
    assert str(cfg) in shown and "num_processes: 2" in shown


# --- bad answers and places: refused in one line, before the questions; the answers never lost -------------

def _answer(monkeypatch, answers, on_last=None):
    """``input()`` gives the next of ``answers`` (an exception is raised instead); ``on_last()`` runs as the last
    one is given. Asking more than was answered fails the test."""
    pending = list(answers)

    def typed(prompt=""):
        print(prompt, end="")
        assert pending, f"asked more than was answered: {prompt}"
        answer = pending.pop(0)
        if not pending and on_last:
            on_last()
        if isinstance(answer, Exception):
            raise answer
        return answer
    monkeypatch.setattr("builtins.input", typed)
    return pending


@pytest.mark.parametrize("where", ["a directory", "a path under a file"])
def test_a_config_file_that_cannot_be_written_is_refused_before_the_first_question(tmp_path, monkeypatch, capsys,
                                                                                   where):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("")
    path = tmp_path / ("d" if where == "a directory" else "f/x.yaml")  # before: IsADirectoryError, FileExistsError
    _answer(monkeypatch, [])  # no question may be asked
    assert config_main(["--config_file", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and f"--config_file {path}:" in err, err


@pytest.mark.parametrize("hf_home", ["under a file", "/proc"])
def test_default_with_an_unwritable_hf_home_is_one_line(tmp_path, monkeypatch, capsys, hf_home):
    # root writes through chmod: a path under a regular file, and /proc (where even root makes no folder)
    if hf_home == "/proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    (tmp_path / "f").write_text("")
    home = str(tmp_path / "f" / "hf") if hf_home == "under a file" else f"/proc/self/miniddp-{os.getpid()}"
    monkeypatch.setenv("HF_HOME", home)
    assert config_main(["--default"]) == 2  # before: NotADirectoryError / FileNotFoundError, a traceback
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and f"HF_HOME={home}" in err and default_config_file() in err


def test_when_the_write_fails_after_the_answers_they_are_printed(tmp_path, monkeypatch, capsys):
    path = tmp_path / "mine.yaml"
    _answer(monkeypatch, ["", "1", "", "", "", "", ""], on_last=path.mkdir)  # the place turns into a folder meanwhile
    assert config_main(["--config_file", str(path)]) == 1  # before: IsADirectoryError, the answers lost
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and str(path) in err
    printed = yaml.safe_load(out[out.rindex("Type its number [0]: ") + len("Type its number [0]: "):])
    assert (printed["distributed_type"], printed["num_processes"], printed["use_cpu"]) == ("MULTI_CPU", 1, True)


def test_numbers_are_ascii_and_bounded_and_the_host_an_address_or_ascii_name(tmp_path, monkeypatch, capsys):
    path = tmp_path / "two.yaml"
    not_utf8 = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")  # a strict terminal, byte 0xff
    answers = ["", "\u0661", "1",  # the machine type: Arabic-Indic 1 refused, then multi-CPU
               "99999999999999999999", "\u0662", "2",  # machines: more than torch can number; Arabic-Indic 2
               not_utf8, "0",  # this machine's rank, after a line that was not UTF-8
               "1.2.3.\udcff", "1.2.3.400", "10.0.0.1",  # a byte that is not UTF-8 (surrogate-escaped); no address
               "\u0662\u0669\u0665\u0660\u0660", "",  # the port in Arabic-Indic digits; the default
               "", "",  # DeepSpeed: no; FSDP: no
               "3", "10000",  # processes: 3 is not a multiple of 2 machines; 10000 on a small machine is allowed
               ""]  # mixed precision: no
    pending = _answer(monkeypatch, answers)
    assert config_main(["--config_file", str(path)]) == 0 and not pending
    shown = capsys.readouterr().out
    assert shown.count("try again") == 8, shown
    cfg = read_config(path)
    assert {k: cfg[k] for k in ("num_machines", "machine_rank", "main_process_ip", "main_process_port",
                                "num_processes")} == {"num_machines": 2, "machine_rank": 0,
                                                      "main_process_ip": "10.0.0.1", "main_process_port": 29500,
                                                      "num_processes": 10000}


def test_a_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        config_main(["--num_processes", "2"])  # argparse's usage and its error: two lines before
    assert stop.value.code == 2 and len(capsys.readouterr().err.splitlines()) == 1


def test_env_says_a_config_path_that_is_a_directory_is_one(tmp_path):
    lines = report(str(tmp_path))  # before: "none at ...", as if there were nothing there
    assert [line for line in lines if str(tmp_path) in line and "directory" in line], lines


def test_fsdp_answers_write_the_block_that_miniddp_launch_reads(tmp_path, monkeypatch, capsys):
    path = tmp_path / "fsdp.yaml"
    pending = _answer(monkeypatch, ["", "1", "",  # this machine, multi-CPU, one machine
                                    "", "y",  # DeepSpeed: no; FSDP: yes
                                    "no",  # reshard after forward: no (shard_grad_op)
                                    "0", "",  # TRANSFORMER_BASED_WRAP; not _no_split_modules: the classes
                                    "Linear,9x", "Linear",  # 9x is no class name
                                    "2",  # processes
                                    "1", "2"])  # mixed precision: fp16 refused with FSDP; bf16
    assert config_main(["--config_file", str(path)]) == 0 and not pending
    assert capsys.readouterr().out.count("try again") == 2
    cfg = read_config(path)
    assert (cfg["distributed_type"], cfg["mixed_precision"]) == ("FSDP", "bf16")
    assert cfg["fsdp_config"] == {"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                                  "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                  "fsdp_transformer_layer_cls_to_wrap": "Linear", "fsdp_offload_params": False,
                                  "fsdp_state_dict_type": "FULL_STATE_DICT"}
    accelerate = pytest.importorskip("accelerate.commands.config.config_args", reason="accelerate is not installed")
    theirs = accelerate.load_config_from_file(str(path))
    assert (theirs.distributed_type.value, theirs.fsdp_config) == ("FSDP", cfg["fsdp_config"])
