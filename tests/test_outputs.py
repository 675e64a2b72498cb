"""Outputs and bad input: no stray or empty file, no input overwritten, every output checked before
the work, the umask respected, no FIFO read, memory estimated first, one clear line."""

from __future__ import annotations

import io
import os
import socket
import stat
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from syncsgd import TrainConfig, train
from syncsgd.cli import main, one_line
from syncsgd.training import checkpoint
from syncsgd.training.loop import save_params
from syncsgd.util import files

TINY = ["--samples", "120", "--features", "4", "--hidden", "4", "--batch-size", "20", "--steps",
        "3", "--quiet"]  # fmt: skip
TINY_CONFIG = TrainConfig(samples=120, features=4, hidden=(4,), batch_size=20, steps=3)


def fails_with(capsys, args: list[str], expected: str, status: int = 1) -> None:
    """`syncsgd ARGS` exits with `status` and one stderr line that holds `expected`."""
    code = main(args)
    err = capsys.readouterr().err
    assert code == status, err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err


def strays(directory) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(".tmp")]


def nameless_files(directory) -> bool:
    """Whether a file can be written here nameless, then named (else a kill may leave a stray)."""
    if not hasattr(os, "O_TMPFILE"):
        return False
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        files._link(fd, os.path.join(directory, "probe"))
    except OSError:
        return False
    finally:
        os.close(fd)
    os.unlink(os.path.join(directory, "probe"))
    return True


def test_a_save_path_without_npz_suffix_holds_the_parameters(tmp_path):
    result = train(TINY_CONFIG, save=str(tmp_path / "params"))
    with np.load(tmp_path / "params") as archive:
        np.testing.assert_array_equal(archive["W0"], result.arrays()["W0"])
    save_params(str(tmp_path / "again"), result)
    assert sorted(os.listdir(tmp_path)) == ["again", "params"]


@pytest.mark.parametrize("path, says", [("", "--save '': an empty path names no file"),
                                         ("newdir/", "not a file name")])  # fmt: skip
def test_a_save_path_naming_no_file_is_refused_and_leaves_nothing(tmp_path, capsys, monkeypatch,
                                                                  path, says):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    fails_with(capsys, ["train", *TINY, "--save", path], says)
    assert os.listdir(tmp_path) == [] and strays(tmp_path.parent) == []


def test_a_killed_run_leaves_no_temporary_log_or_parameters(tmp_path):
    if not nameless_files(tmp_path):
        pytest.skip("this kernel or user cannot name a nameless file: a kill may leave a .tmp file")
    ckpt = tmp_path / "ckpt"
    args = ["train", "--samples", "400", "--features", "4", "--hidden", "4", "--batch-size", "20",
            "--steps", "1000000", "--quiet", "--checkpoint", str(ckpt), "--checkpoint-every", "5",
            "--log", str(tmp_path / "log.jsonl"), "--save", str(tmp_path / "p.npz")]  # fmt: skip
    job = subprocess.Popen([sys.executable, "-m", "syncsgd.cli", *args])
    deadline = time.monotonic() + 120
    try:
        while not (ckpt / "ckpt-00000010.npz").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        job.kill()  # SIGKILL: no handler, no clean-up
        job.wait(timeout=30)
    assert (ckpt / "ckpt-00000010.npz").exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert strays(ckpt) == []


def test_writing_a_new_file_never_gives_any_other_name_in_its_directory(tmp_path, monkeypatch):
    if not nameless_files(tmp_path):
        pytest.skip("this kernel or user cannot name a nameless file")
    seen: list[list[str]] = []

    def watched(call):
        def spy(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            finally:
                seen.append(sorted(os.listdir(tmp_path)))

        return spy

    for name in ("open", "link", "replace", "close"):
        monkeypatch.setattr(os, name, watched(getattr(os, name)))
    with files.atomic_file(tmp_path / "new.npz") as handle:
        handle.write(b"bytes")
    monkeypatch.undo()
    assert seen and all(names in ([], ["new.npz"]) for names in seen), seen
    assert (tmp_path / "new.npz").read_bytes() == b"bytes"


@pytest.mark.parametrize(
    "make, args, expected",
    [
        ("d.npz", ["--data", "d.npz", "--save", "d.npz"], "--save d.npz is the same file as"),
        ("d.csv", ["--data", "d.csv", "--log", "d.csv"], "--log d.csv is the same file as --data"),
        (None, ["--save", "x.npz", "--log", "x.npz"], "--log x.npz is the same file as --save"),
        ("i.npz", ["--init", "i.npz", "--timeline", "./i.npz"], "same file as --init i.npz"),
        (None, ["--timeline", "t.png", "--timeline-png", "t.png"],
         "--timeline-png t.png is the same file as"),
    ],
)  # fmt: skip
def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path, capsys, monkeypatch,
                                                                 make, args, expected):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    if make == "d.csv":
        (tmp_path / make).write_text("".join(f"{i},{i % 3},{i % 2}\n" for i in range(60)))
    elif make is not None:
        X = np.random.default_rng(0).normal(size=(60, 4))
        np.savez(tmp_path / make, X=X, y=np.arange(60) % 2)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    fails_with(capsys, ["train", *TINY, *args], expected)
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_devices_and_fifos_are_refused_and_symlinks_written_through(tmp_path, capsys):
    fails_with(capsys, ["train", *TINY, "--save", os.devnull], "not a regular file")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    os.mkfifo(tmp_path / "fifo")
    fails_with(capsys, ["train", *TINY, "--log", str(tmp_path / "fifo")], "not a regular file")
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)
    (tmp_path / "link.npz").symlink_to("real.npz")
    assert main(["train", *TINY, "--save", str(tmp_path / "link.npz")]) == 0
    assert (tmp_path / "link.npz").is_symlink() and (tmp_path / "real.npz").is_file()


def test_an_unwritable_output_is_found_before_training(tmp_path, capsys, monkeypatch):
    def refuse(directory):
        raise PermissionError(13, "Permission denied")

    # Root may write into a mode 0555 directory: the check's own file creation is made to fail.
    monkeypatch.setattr(files, "_probe", refuse)
    monkeypatch.setattr("syncsgd.training.loop.prepare", lambda *a, **k: pytest.fail("trained"))
    fails_with(capsys, ["train", *TINY, "--save", str(tmp_path / "p.npz")], "Permission denied")


@pytest.mark.parametrize("command", [["verify", "--steps", "2"], ["bench", "step", "--ranks", "1"]])
def test_verify_and_bench_step_check_their_json_path_first(tmp_path, capsys, command):
    fails_with(capsys, [*command, "--json", str(tmp_path / "missing" / "r.json")],
               "does not exist")  # fmt: skip


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_outputs_respect_the_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        train(TINY_CONFIG, save=str(tmp_path / "p.npz"), log=str(tmp_path / "log"),
              checkpoint=str(tmp_path / "ckpt"))  # fmt: skip
        files.write_text(tmp_path / "t.txt", "text")
    finally:
        os.umask(previous)
    for path in (tmp_path / "p.npz", tmp_path / "log", tmp_path / "ckpt" / "ckpt-00000003.npz",
                 tmp_path / "t.txt"):  # fmt: skip
        assert stat.S_IMODE(os.stat(path).st_mode) == mode, path


@pytest.mark.parametrize("option", ["--init", "--resume", "--data"])
def test_a_fifo_as_input_is_refused_not_read(tmp_path, option):
    os.mkfifo(tmp_path / "ckpt-00000001.npz")
    path = tmp_path if option == "--resume" else tmp_path / "ckpt-00000001.npz"
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "train", *TINY, option, str(path)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


def huge_npz(path) -> None:
    """An .npz whose X header claims 10^13 float64 (80 TB) and holds almost nothing."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": (10**7, 10**6)}
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("X.npy", header.getvalue() + b"\0" * 64)
        archive.writestr("y.npy", header.getvalue())


@pytest.mark.parametrize(
    "args",
    [["--hidden", "100000,100000"], ["--features", "1000000000"], ["--classes", "1000000000"],
     ["--samples", "1000000000", "--features", "1000"], ["--data", "huge.npz"],
     ["--init", "huge.npz"]],
)  # fmt: skip
def test_a_run_beyond_the_memory_is_refused_before_allocating(tmp_path, capsys, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    huge_npz(tmp_path / "huge.npz")
    fails_with(capsys, ["train", "--steps", "1", *args], "of memory needed")


def test_a_met_target_ends_the_count_the_summary_and_the_checkpoints(tmp_path, capsys):
    code = main(["train", "--samples", "400", "--steps", "500", "--holdout", "0.2",
                 "--target-accuracy", "0.5", "--checkpoint", str(tmp_path)])  # fmt: skip
    assert code == 0
    result = train(samples=400, steps=500, holdout=0.2, target_accuracy=0.5)
    assert result.steps == result.steps_to_target < 500
    assert f"trained {result.steps} steps" in capsys.readouterr().out
    assert os.listdir(tmp_path) == [f"ckpt-{result.steps:08d}.npz"]


def test_a_checkpoint_directory_in_use_is_refused(tmp_path, capsys):
    (tmp_path / "lock").write_text(f"{socket.gethostname()} {os.getpid()} another-run\n")
    fails_with(capsys, ["train", *TINY, "--checkpoint", str(tmp_path)],
               f"in use by process {os.getpid()}")  # fmt: skip
    (tmp_path / "lock").write_text(f"{socket.gethostname()} 999999999 a-dead-run\n")  # stale
    assert main(["train", *TINY, "--checkpoint", str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000003.npz"]  # the lock went with its run


def test_resume_takes_the_newest_checkpoint_of_this_run(tmp_path):
    train(TINY_CONFIG, checkpoint=str(tmp_path), checkpoint_every=1)
    other = train(TINY_CONFIG, lr=0.2, steps=5, checkpoint=str(tmp_path / "other"))
    os.replace(tmp_path / "other" / "ckpt-00000005.npz", tmp_path / "ckpt-00000005.npz")
    resumed = train(TINY_CONFIG, steps=4, resume=str(tmp_path))
    assert resumed.steps == 4 and len(resumed.losses) == 1  # from step 3: its own run's newest
    assert other.steps == 5


def test_a_checkpoint_whose_step_is_not_a_count_is_refused(tmp_path):
    state = checkpoint.Checkpoint(2, np.zeros(3), {})
    path = checkpoint.save(str(tmp_path), state, "run")
    with np.load(path) as archive:
        arrays = {name: archive[name] for name in archive.files}
    arrays["step"] = np.array(2.7)
    arrays.pop("checksum")
    arrays["checksum"] = np.array(checkpoint.checksum(arrays))
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="step 2.7 is not a step count"):
        checkpoint.load(path, "run", 3, np.dtype("float64"))


def test_messages_name_the_problem(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.npz").write_text("not an archive\n")
    fails_with(capsys, ["train", *TINY, "--data", "text.npz"], "is not an .npz file")
    fails_with(capsys, ["train", *TINY, "--init", "text.npz"], "is not an .npz file")
    assert "allow_pickle" not in capsys.readouterr().err
    X = np.random.default_rng(0).normal(size=(60, 4))
    with open(tmp_path / "GOOD.NPZ", "wb") as handle:  # a name would get .npz appended
        np.savez(handle, X=X, y=np.arange(60) % 2)
    assert main(["train", *TINY, "--data", "GOOD.NPZ", "--batch-size", "10"]) == 0
    (tmp_path / "typo.csv").write_text("1,2x,0\n" + "".join(f"{i},1,{i % 2}\n" for i in range(40)))
    fails_with(capsys, ["train", *TINY, "--data", "typo.csv"], "line 1: '2x' is not a number")
    np.savez(tmp_path / "big.npz", X=np.full((60, 4), 1e300), y=np.arange(60) % 2)
    fails_with(capsys, ["train", *TINY, "--data", "big.npz", "--dtype", "float32"], "infinite")
    diverging = ["--lr", "1e10", "--loss", "mse", "--data", "synthetic-regression", "--steps", "40",
                 "--skip-nonfinite", "--ranks", "2"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "train", *TINY, *diverging],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr
    assert one_line(FileNotFoundError(2, "No such file or directory", "x.npz")) == (
        "x.npz: No such file or directory"
    )


@pytest.mark.parametrize(
    "args, expected",
    [(["--ranks", "1", "--noise-scale"], "--noise-scale needs 2 or more ranks"),
     (["--holdout", "0.2", "--target-accuracy", "2"], "--target-accuracy must be in [0, 1]"),
     (["--classes", "1"], "needs at least 2 classes")],
)  # fmt: skip
def test_options_that_cannot_work_are_refused(capsys, args, expected):
    fails_with(capsys, ["train", *TINY, *args], expected)


@pytest.mark.parametrize(
    "field, value, expected",
    [("lr", "abc", "--lr must be a number"), ("steps", 2.5, "--steps must be an integer or None"),
     ("hidden", 5, "--hidden must be a tuple of integers"), ("seed", True, "--seed must be an"),
     ("data", 3, "--data must be a string"), ("lr", float("nan"), "--lr must be a finite")],
)  # fmt: skip
def test_config_fields_of_the_wrong_type_are_one_clear_value_error(field, value, expected):
    with pytest.raises(ValueError, match=expected.replace("[", r"\[")):
        TrainConfig(**{field: value})


def test_newcomer_polish(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("syncsgd ")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--hidden", "64,x"])
    assert exit_info.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    helped = capsys.readouterr().out.split("options:")[1]
    options = [chunk for chunk in helped.split("\n  -") if chunk.strip()][1:]  # after -h
    assert options and all("default" in " ".join(chunk.split()) for chunk in options)
    assert main(["train", *TINY, "--debug"]) == 0
