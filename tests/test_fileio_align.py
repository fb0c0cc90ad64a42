"""The ``O_DIRECT`` alignment is read at run time (page size, file system block size,
``$SPARKV_IO_ALIGN``), and the flash tier, the device service's files and DynaKV's page files work
at 4 KiB and at a forced 16 KiB (a phone's page): every direct request's offset, length and buffer
are aligned, the data round trips, and ``O_DIRECT`` stays on where the file system takes it."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest

from sparkv import fileio
from sparkv.cache import FlashTier
from sparkv.decode.store import PAGE, IOStats, PageFile
from sparkv.device.flashio import ServiceFlash
from sparkv.fileio import ALIGN_ENV, FlashIO, atomic_write, io_alignment, page_size

ALIGNMENTS = [4096, 16384]


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _direct_works(path) -> bool:
    """Whether this file system takes an ``O_DIRECT`` open at all (tmpfs before Linux 6.6 does
    not)."""
    if not fileio.O_DIRECT:
        return False
    try:
        fd = os.open(path / ".probe", os.O_RDWR | os.O_CREAT | fileio.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    os.close(fd)
    os.unlink(path / ".probe")
    return True


@pytest.fixture
def direct_calls(monkeypatch):
    """Records ``(offset, length, buffer address)`` of every ``preadv``/``pwritev`` (the direct
    path: buffered I/O uses ``pread``/``pwrite``)."""
    calls: list[tuple[str, int, int, int]] = []
    for name in ("preadv", "pwritev"):
        real = getattr(os, name)

        def spy(fd, bufs, offset, _real=real, _name=name):
            for b in bufs:
                calls.append((_name, offset, len(b), _address(b)))
            return _real(fd, bufs, offset)
        monkeypatch.setattr(os, name, spy)
    return calls


# ---- the alignment read at run time ----------------------------------------------------------------
def test_the_alignment_is_the_larger_of_page_and_block(tmp_path, monkeypatch):
    monkeypatch.delenv(ALIGN_ENV, raising=False)
    assert io_alignment(tmp_path) == max(page_size(), os.statvfs(tmp_path).f_bsize)
    monkeypatch.setattr(fileio, "page_size", lambda: 16384)       # a 16 KiB-page phone
    assert io_alignment(tmp_path) == max(16384, os.statvfs(tmp_path).f_bsize)
    assert FlashTier(tmp_path / "t").io.align == io_alignment(tmp_path)

    class Stat:
        f_bsize = 65536
    monkeypatch.setattr(os, "statvfs", lambda p: Stat)            # a 64 KiB-block file system
    assert io_alignment(tmp_path) == 65536
    Stat.f_bsize = 3000                                           # nonsense: the page size
    assert io_alignment(tmp_path) == 16384


def test_the_environment_forces_an_alignment_on_every_user(tmp_path, monkeypatch):
    monkeypatch.setenv(ALIGN_ENV, "16384")
    assert io_alignment(tmp_path) == 16384
    assert FlashTier(tmp_path / "a").io.align == 16384
    assert ServiceFlash(tmp_path / "b").io.align == 16384
    f = PageFile(tmp_path / "p", IOStats())
    assert f.flash.io.align == 16384
    f.close()
    assert FlashTier(tmp_path / "c", align=4096).io.align == 4096    # an explicit align wins


@pytest.mark.parametrize("bad", ["4000", "256", "abc", str(2 << 20), "-4096"])
def test_a_bad_forced_alignment_is_a_clear_error(tmp_path, monkeypatch, bad):
    monkeypatch.setenv(ALIGN_ENV, bad)
    with pytest.raises(ValueError, match=ALIGN_ENV):
        FlashTier(tmp_path)


@pytest.mark.parametrize("align", ALIGNMENTS)
def test_buffers_are_aligned(tmp_path, align):
    io = FlashIO(tmp_path, align=align)
    for n in (1, align, 3 * align + 7, (1 << 20) - 1, (2 << 20) + 5):
        with io.buffer(n) as view:
            assert len(view) == n and _address(view) % align == 0
            view[-1:] = b"x"                                        # writable to its end


# ---- users at 4 KiB and 16 KiB ---------------------------------------------------------------------
@pytest.mark.parametrize("align", ALIGNMENTS)
def test_the_flash_tier_at_an_alignment(tmp_path, monkeypatch, direct_calls, align):
    monkeypatch.setenv(ALIGN_ENV, str(align))
    tier = FlashTier(tmp_path / "tier")
    blobs = {f"{i}.skvc": os.urandom(n) for i, n in
             enumerate([1, 4095, 4097, align, align + 1, 5 * align - 3, 300_000])}
    refs = {name: tier.write(name, b) for name, b in blobs.items()}
    for name, b in blobs.items():
        assert tier.read(refs[name]) == b
    if _direct_works(tmp_path):
        assert tier.direct                                          # nothing was refused
        assert direct_calls                                         # and reads went direct
    for _, offset, length, address in direct_calls:
        assert offset % align == 0 and length % align == 0 and address % align == 0


@pytest.mark.parametrize("align", ALIGNMENTS)
def test_the_device_service_files_at_an_alignment(tmp_path, monkeypatch, direct_calls, align):
    """The service's grouped writes and token chunk reads (sparkv.device.flashio)."""
    monkeypatch.setenv(ALIGN_ENV, str(align))
    tier = ServiceFlash(tmp_path / "svc")
    with tier.batch():
        refs = [tier.write(f"{i}.skvt", bytes([i]) * (7000 + 9000 * i)) for i in range(4)]
    assert [tier.read(r) for r in refs] == [bytes([i]) * (7000 + 9000 * i) for i in range(4)]
    if _direct_works(tmp_path):
        assert tier.direct and direct_calls
    for _, offset, length, address in direct_calls:
        assert offset % align == 0 and length % align == 0 and address % align == 0


@pytest.mark.parametrize("align", ALIGNMENTS)
def test_positioned_io_at_an_alignment(tmp_path, direct_calls, align):
    """Aligned writes go direct, unaligned ones buffered; every read takes the aligned span."""
    io = FlashIO(tmp_path, align=align)
    blob = os.urandom(4 * align)
    with io.open(tmp_path / "f", create=True) as f:
        f.pwrite(0, blob[:align])                                   # aligned
        f.pwrite(align, blob[align:align + 4096])                   # 4 KiB: aligned at 4 KiB only
        f.pwrite(align + 4096, blob[align + 4096:])
        for off, n in [(0, len(blob)), (3, 5), (align - 1, 2), (align, 4096), (len(blob) - 1, 9)]:
            assert f.pread(off, n) == blob[off:off + n]
        if _direct_works(tmp_path):
            assert io.direct
            writes = [c for c in direct_calls if c[0] == "pwritev"]
            assert writes[0][1:3] == (0, align)
            assert len(writes) == (3 if align == 4096 else 1)
    for _, offset, length, address in direct_calls:
        assert offset % align == 0 and length % align == 0 and address % align == 0


@pytest.mark.parametrize("align", ALIGNMENTS)
def test_page_files_at_an_alignment(tmp_path, monkeypatch, align):
    """DynaKV's 4 KiB format pages under a 16 KiB alignment: written buffered, read back whole."""
    monkeypatch.setenv(ALIGN_ENV, str(align))
    f = PageFile(tmp_path / "pages", IOStats())
    pages = {p: os.urandom(PAGE) for p in (4, 0, 1, 2, 3, 9)}
    for p, data in pages.items():
        f.write(p, data, "append")
    f.flush()
    assert f.read(0, 5) == b"".join(pages[p] for p in range(5))
    assert f.read(9, 1) == pages[9]
    f.close()


def test_atomic_writes_are_alignment_free(tmp_path, monkeypatch):
    monkeypatch.setenv(ALIGN_ENV, "16384")
    atomic_write(tmp_path / "x", b"abc")
    assert FlashIO(tmp_path).read_file(tmp_path / "x") == b"abc"
