"""The llama.cpp comparison keeps each finished window (``windows/window-NNNN.npz``) so that an interrupted run
resumes: written through kvquant.fs (a symlink planted at the file or its temporary name is never written through),
and a window kept under other inputs is set aside (``.old``), never overwritten (issue 58)."""

import os

import numpy as np
import pytest

from kvquant.errors import KVQuantError
from kvquant.integrations.llamacpp_engine import load_window, save_window, window_file


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"int8|llamacpp|kl": rng.exponential(0.01, 31), "int8|llamacpp|top1": rng.random(31) < 0.9}


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_symlink_at_the_window_or_its_temporary_name_is_not_written_through(tmp_path):
    folder, victim = tmp_path / "windows", tmp_path / "victim.txt"
    folder.mkdir()
    victim.write_text("another file")
    for name in ("window-0001.npz", "window-0001.tmp.npz", "window-0002.npz"):
        os.symlink(victim, folder / name)
    kept = arrays(1)
    save_window(folder, 1, "key-a", kept)
    assert victim.read_text() == "another file"
    path = window_file(folder, 1)
    assert path.is_file() and not path.is_symlink()
    assert same(load_window(folder, 1, "key-a"), kept)
    assert load_window(folder, 2, "key-a") is None  # a symlink is never read either


def test_a_window_of_other_inputs_is_set_aside_not_overwritten(tmp_path):
    folder = tmp_path / "windows"
    first, second = arrays(1), arrays(2)
    save_window(folder, 3, "key-a", first)
    assert load_window(folder, 3, "key-b") is None  # other inputs: measured again ...
    save_window(folder, 3, "key-b", second)  # ... and the earlier window kept beside
    assert same(load_window(folder, 3, "key-b"), second)
    aside = folder / "window-0003.npz.old"
    with np.load(aside, allow_pickle=False) as data:
        assert str(data["key"]) == "key-a" and same({k: data[k] for k in data.files if k != "key"}, first)
    save_window(folder, 3, "key-a", first)  # once more: the earlier set-aside copy is not overwritten
    assert (folder / "window-0003.npz.old.1").is_file() and aside.is_file()
    save_window(folder, 3, "key-a", second)  # the same inputs again (a window measured anew): replaced in place
    assert same(load_window(folder, 3, "key-a"), second) and not (folder / "window-0003.npz.old.2").exists()


def test_a_symlink_in_place_of_the_windows_folder_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "windows")
    with pytest.raises(KVQuantError, match="symlink"):
        save_window(tmp_path / "windows", 1, "key-a", arrays(1))
    assert not list((tmp_path / "elsewhere").iterdir())


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04cut", b"\x93NUMPY", b"plain text"],
                         ids=["empty", "cut-zip", "cut-npy", "text"])
def test_an_unreadable_window_is_measured_again_and_set_aside(tmp_path, content):
    """An empty or cut file (a machine that lost power) was an internal error when read (EOFError, BadZipFile)."""
    folder = tmp_path / "windows"
    folder.mkdir()
    window_file(folder, 1).write_bytes(content)
    assert load_window(folder, 1, "key-a") is None
    save_window(folder, 1, "key-a", arrays(1))
    assert same(load_window(folder, 1, "key-a"), arrays(1))
    assert (folder / "window-0001.npz.corrupt").read_bytes() == content


def test_a_lone_array_file_is_no_window(tmp_path):
    folder = tmp_path / "windows"
    folder.mkdir()
    np.save(folder / "lone.npy", np.arange(3))
    os.replace(folder / "lone.npy", window_file(folder, 1))
    assert load_window(folder, 1, "key-a") is None
