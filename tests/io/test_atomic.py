import os
import stat

import pytest
import torch

import minifloat
from minifloat import MinifloatError
from minifloat.io.atomic import atomic_path


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_file_gets_the_umask_mode_and_a_replaced_file_keeps_its_own(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "a.txt") as tmp:
            tmp.write_text("one")
        assert _mode(tmp_path / "a.txt") == 0o644  # as open() would make it, not mkstemp's 0600
        os.chmod(tmp_path / "a.txt", 0o640)
        with atomic_path(tmp_path / "a.txt") as tmp:
            tmp.write_text("two")
        assert (tmp_path / "a.txt").read_text() == "two" and _mode(tmp_path / "a.txt") == 0o640
    finally:
        os.umask(old)


def test_a_writer_that_replaces_the_temporary_does_not_change_the_mode(tmp_path):
    # safetensors' save_file writes its own file (0600) and renames it over the path it is given
    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "w.safetensors") as tmp:
            tmp.unlink()
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
        assert _mode(tmp_path / "w.safetensors") == 0o644
        minifloat.save(tmp_path / "q.safetensors", {"q": minifloat.quantize(torch.ones(4, 32), "mxfp4")})
        assert _mode(tmp_path / "q.safetensors") == 0o644
    finally:
        os.umask(old)


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    (tmp_path / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "a.txt") as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert (tmp_path / "a.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_a_directory_is_not_a_file_path(tmp_path):
    with pytest.raises(MinifloatError, match=f"{tmp_path} is a directory; pass a file path inside it"):
        with atomic_path(tmp_path):
            pass
    assert [p.name for p in tmp_path.iterdir()] == []


def test_the_rename_is_flushed_to_disk_with_the_file(tmp_path, monkeypatch):
    """The file is fsynced before the rename and its folder after it, so that a crash cannot
    leave the old name pointing at nothing (a checkpoint's `latest`, before old ones go)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with atomic_path(tmp_path / "a.txt") as tmp:
        tmp.write_text("one")
    assert events == [("fsync", "file"), ("replace", "a.txt"), ("fsync", "dir")]


def test_a_missing_parent_folder_is_created(tmp_path):
    with atomic_path(tmp_path / "a" / "b" / "c.txt") as tmp:
        tmp.write_text("x")
    assert (tmp_path / "a" / "b" / "c.txt").read_text() == "x"


def test_remove_deletes_a_tree_or_a_file_and_only_the_link_of_a_linked_folder(tmp_path):
    from minifloat.io.atomic import remove

    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "f").write_text("x")
    (tmp_path / "file").write_text("x")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "g").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "kept", target_is_directory=True)
    for name in ("tree", "file", "link", "missing"):
        remove(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and (tmp_path / "kept" / "g").exists()


def test_temporary_names_retry_on_a_collision_and_give_up_with_an_error(tmp_path, monkeypatch):
    import secrets

    from minifloat.io.atomic import make_dir_beside

    tags = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(tags))
    (tmp_path / ".ckpt-aaaa").mkdir()
    old = os.umask(0o022)
    try:
        made = make_dir_beside(tmp_path / "ckpt-1", "ckpt-")
    finally:
        os.umask(old)
    assert made == tmp_path / ".ckpt-bbbb" and _mode(made) == 0o755  # as mkdir makes it, not mkdtemp's 0700
    monkeypatch.setattr(secrets, "token_hex", lambda n: "aaaa")
    with pytest.raises(MinifloatError, match="could not create a temporary file or folder beside"):
        make_dir_beside(tmp_path / "ckpt-1", "ckpt-")
