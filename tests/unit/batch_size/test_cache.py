"""The finder's disk cache: hits cost one step, and a cache entry is never trusted past what it
proves - a cap, the real parameter dtypes, a stale smaller size, a damaged file, a shared folder."""

import json
import os
import stat
import threading
import warnings

import pytest
import torch
from tiny import batches

from hf_memstack import find_batch_size, parse_bytes, prepare_model
from hf_memstack.batch_size.cache import CachedStep, CacheEntry, cache_key, read_entry, write_entry

BUDGET = "12MiB"


@pytest.fixture
def llama(load_model):
    model = prepare_model(load_model("llama"), "bf16")
    return model, torch.optim.AdamW(model.parameters())


def find(model, opt, cache_dir, **kwargs):
    return find_batch_size(
        model, kwargs.pop("make", batches()), opt, budget=kwargs.pop("budget", BUDGET), cache_dir=cache_dir, **kwargs
    )


def test_hit_costs_one_step_and_a_stale_entry_is_searched_again(llama, tmp_path):
    model, opt = llama
    first = find(model, opt, tmp_path)
    assert first.cache == "miss" and first.steps_run >= 3
    second = find(model, opt, tmp_path)
    assert second.cache_hit and second.steps_run == 1 and second.batch_size == first.batch_size
    longer = find(model, opt, tmp_path, make=batches(seq=64))  # another job: another entry
    assert longer.cache == "miss" and longer.batch_size < first.batch_size and longer.cache_file != first.cache_file
    path = tmp_path / "batch_size" / first.cache_file.rsplit("/", 1)[-1]
    data = json.loads(path.read_text())

    # As if found when the device held more (or less) besides: each entry consistent with its own steps.
    def found_at(n):
        return {**data, "batch_size": n, "steps": [{"batch_size": n, "peak_bytes": data["peak_bytes"], "fits": True}]}

    # A smaller entry fits, but it is not the maximum any more: searched again, not accepted.
    path.write_text(json.dumps(found_at(first.batch_size // 2)))
    smaller = find(model, opt, tmp_path)
    assert smaller.cache == "stale" and smaller.batch_size == first.batch_size
    # A larger entry that no longer fits: searched again.
    path.write_text(json.dumps(found_at(first.batch_size * 4)))
    larger = find(model, opt, tmp_path)
    assert larger.cache == "stale" and larger.batch_size == first.batch_size and larger.over_budget_probes == 1
    assert json.loads(path.read_text())["batch_size"] == first.batch_size
    off = find_batch_size(model, batches(), opt, budget=BUDGET, cache=False)
    assert off.cache == "off" and off.cache_file is None


def test_cache_honours_max_batch_size(llama, tmp_path):
    model, opt = llama
    full = find(model, opt, tmp_path)
    assert full.batch_size > 4
    capped = find(model, opt, tmp_path, max_batch_size=4)
    assert (capped.batch_size, capped.capped, capped.cache, capped.steps_run) == (4, True, "hit", 1)
    # An entry found under a cap says nothing above it: a larger cap searches again.
    find(model, opt, tmp_path / "other", max_batch_size=4)
    again = find(model, opt, tmp_path / "other")
    assert again.cache == "stale" and again.batch_size == full.batch_size


def test_key_sees_real_parameter_dtypes_and_trainability(load_model):
    def key(model):
        return cache_key(model, None, policy=None, batch=[["int64", 32]], mode="train", budget=1, loss_fn=None)

    fp32 = load_model("llama")
    bf16 = load_model("llama").to(torch.bfloat16)  # same config, bf16 weights: half the bytes
    frozen = load_model("llama")
    frozen.model.embed_tokens.weight.requires_grad_(False)
    assert len({key(fp32), key(bf16), key(frozen)}) == 3 and key(fp32) == key(load_model("llama"))


STEPS = '"steps": [{"batch_size": 12, "peak_bytes": 100, "fits": true}]'


@pytest.mark.parametrize(
    "content",
    [
        '{"batch_size": 12, "peak_by',  # truncated
        '{"batch_size": 12, "peak_bytes": 100, "bytes_per_sample": 1, "capped": false}',  # an older entry: no steps
        '{"batch_size": 12, "peak_bytes": 100, "bytes_per_sample": 1, "capped": false, "steps": []}',
        '{"batch_size": 12, "peak_bytes": 100, "bytes_per_sample": 1, "capped": false, "steps": [{"batch_size": 12}]}',
        '{"batch_size": 12, "peak_bytes": 100, "bytes_per_sample": 1, "capped": false, "steps": '
        '[{"batch_size": 12, "peak_bytes": null, "fits": true}]}',
        '{"peak_bytes": 100, "bytes_per_sample": 1, "capped": false}',  # missing batch_size
        '{"batch_size": 0, "peak_bytes": 100, "bytes_per_sample": 1, "capped": false}',
        '{"batch_size": -3, "peak_bytes": 100, "bytes_per_sample": 1, "capped": false}',
        '{"batch_size": true, "peak_bytes": 100, "bytes_per_sample": 1, "capped": false}',
        "[12]",
        "\udcff",
    ],
)
def test_invalid_entries_are_discarded_with_a_warning(tmp_path, content):
    path = tmp_path / "entry.json"
    path.write_text(content, errors="surrogateescape")
    with pytest.warns(UserWarning, match=r"discarding the invalid batch-size cache entry .*entry.json"):
        assert read_entry(path, budget=1000) is None
    assert not path.exists()


@pytest.mark.parametrize(
    "edit, why",
    [
        ({"batch_size": 60000}, "batch_size=60000 with peak_bytes=100 is not what its recorded steps found"),
        ({"peak_bytes": 5000}, "peak_bytes=5000 is above the budget of 1000 bytes"),
        ({"steps": [{"batch_size": 12, "peak_bytes": 100, "fits": False}]}, "none of its recorded steps fitted"),
        (
            {
                "steps": [
                    {"batch_size": 4, "peak_bytes": None, "fits": False},
                    {"batch_size": 12, "peak_bytes": 100, "fits": True},
                ]
            },
            "batch size 4 did not fit, yet the larger batch_size=12 did",
        ),
        (
            {
                "steps": [
                    {"batch_size": 12, "peak_bytes": 100, "fits": True},
                    {"batch_size": 2, "peak_bytes": 2000, "fits": True},
                ]
            },
            "a recorded step at batch size 2 fitted with a peak above the budget",
        ),
    ],
)
def test_an_entry_inconsistent_with_its_own_steps_or_the_budget_is_discarded(tmp_path, edit, why):
    path = tmp_path / "entry.json"
    good = {
        "batch_size": 12,
        "peak_bytes": 100,
        "bytes_per_sample": 1,
        "capped": False,
        **json.loads("{" + STEPS + "}"),
    }
    path.write_text(json.dumps(good))
    assert read_entry(path, budget=1000).batch_size == 12  # as written: consistent
    path.write_text(json.dumps({**good, **edit}))
    with pytest.warns(UserWarning, match="discarding the batch-size cache entry .*entry.json") as warned:
        assert read_entry(path, budget=1000) is None
    assert why in str(warned[0].message), str(warned[0].message)
    assert not path.exists()


def test_an_edited_entry_never_asks_make_batch_for_its_size(llama, tmp_path):
    """A cache file edited to batch_size=60000: discarded, with a warning naming the file, before a
    batch that size is built (it used to be built, then measured)."""
    model, opt = llama
    first = find(model, opt, tmp_path)
    path = tmp_path / "batch_size" / first.cache_file.rsplit("/", 1)[-1]
    path.write_text(json.dumps({**json.loads(path.read_text()), "batch_size": 60000}))
    asked = []

    def make(n):
        asked.append(n)
        return batches()(n)

    with pytest.warns(UserWarning, match=f"discarding the batch-size cache entry {path}: batch_size=60000"):
        again = find(model, opt, tmp_path, make=make)
    assert max(asked) < 60000 and again.cache == "miss" and again.batch_size == first.batch_size
    assert json.loads(path.read_text())["batch_size"] == first.batch_size  # measured again and rewritten


def test_a_damaged_entry_is_searched_again_and_replaced(llama, tmp_path):
    model, opt = llama
    first = find(model, opt, tmp_path)
    path = tmp_path / "batch_size" / first.cache_file.rsplit("/", 1)[-1]
    path.write_text(path.read_text()[:10])
    with pytest.warns(UserWarning, match="discarding the invalid"):
        again = find(model, opt, tmp_path)
    assert again.cache == "miss" and again.batch_size == first.batch_size
    assert read_entry(path, budget=parse_bytes(BUDGET)).batch_size == first.batch_size


def test_concurrent_writers_never_crash_or_mix(tmp_path):
    path = tmp_path / "batch_size" / "job.json"
    entries = [
        CacheEntry(
            batch_size=n,
            peak_bytes=1000 * n,
            bytes_per_sample=10,
            capped=False,
            steps=(CachedStep(batch_size=n, peak_bytes=1000 * n, fits=True),),
        )
        for n in range(1, 9)
    ]
    errors, seen = [], []

    def writer(entry):
        try:
            for _ in range(50):
                write_entry(path, entry)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    def reader():
        for _ in range(200):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a partial file would be discarded with a warning
                entry = read_entry(path, budget=10_000)
            if entry is not None:
                seen.append(entry)

    threads = [threading.Thread(target=writer, args=(e,)) for e in entries] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(e in entries for e in seen)  # every read is one writer's whole entry, never a mix
    assert read_entry(path, budget=10_000) in entries and not list(path.parent.glob("*.tmp"))


def test_unwritable_cache_folder_warns_and_returns_the_result(llama, tmp_path):
    model, opt = llama
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with pytest.warns(UserWarning, match=r"could not write the batch-size cache .*returned but not cached"):
        result = find(model, opt, blocker)
    assert result.batch_size >= 2 and result.cache == "miss"


def test_cache_folder_is_private(llama, tmp_path):
    model, opt = llama
    find(model, opt, tmp_path / "fresh", max_batch_size=2)
    for folder in (tmp_path / "fresh", tmp_path / "fresh" / "batch_size"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def _in_thread(fn, fifo=None, timeout=30):
    """``fn()``'s value and the warnings it gave, run in a thread: a read blocked on a FIFO fails the
    test after ``timeout`` seconds (the FIFO is then opened for writing once, so the reader ends)."""
    out = {}

    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["value"] = fn()
        out["warnings"] = [str(w.message) for w in caught]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked open() returns, reads EOF
        thread.join(10)
        pytest.fail(f"blocked for {timeout} s (a FIFO read waits for a writer)")
    return out["value"], out["warnings"]


def _valid_entry_json():
    return json.dumps(
        {"batch_size": 12, "peak_bytes": 100, "bytes_per_sample": 1, "capped": False, **json.loads("{" + STEPS + "}")}
    )


@pytest.mark.parametrize("kind", ["symlink to an entry elsewhere", "FIFO", "directory"])
def test_an_entry_that_is_not_a_regular_file_is_never_read_nor_removed(tmp_path, kind):
    """cache_dir= can point anywhere: a link (to a valid entry elsewhere, or to /dev/zero), a FIFO
    (a read blocked find_batch_size forever) or a directory at an entry's path is named and left
    alone - not followed, not read, not deleted."""
    path = tmp_path / "entry.json"
    outside = tmp_path / "elsewhere.json"
    outside.write_text(_valid_entry_json())
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(outside)
    entry, said = _in_thread(lambda: read_entry(path, budget=1000), fifo=path if kind == "FIFO" else None)
    assert entry is None
    named = kind.split()[0].replace("FIFO", "a FIFO (named pipe)").replace("symlink", "a symlink")
    named = named.replace("directory", "a directory")
    assert len(said) == 1 and f"entry {path} is {named}, not a file hf_memstack wrote" in said[0], said
    assert "left as it is" in said[0], said
    assert os.path.lexists(path) and outside.read_text() == _valid_entry_json()


def test_an_entry_linked_to_dev_zero_is_not_read(tmp_path):
    """It was read until the kernel's OOM killer stopped the process (~20 GiB); here a 1 GiB address
    space limit turns such a read into a MemoryError in a child process instead."""
    import subprocess
    import sys

    path = tmp_path / "entry.json"
    path.symlink_to("/dev/zero")
    code = (
        "import resource, sys, warnings\n"
        "from pathlib import Path\n"
        "from hf_memstack.batch_size.cache import read_entry\n"
        "vm = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(read_entry(Path(sys.argv[1]), budget=1000))\n"
        "print([str(w.message) for w in caught])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("None\n") and f"entry {path} is a symlink, not a file" in done.stdout, done.stdout
    assert path.is_symlink()


def test_an_oversized_entry_is_discarded_unread(tmp_path):
    path = tmp_path / "entry.json"
    path.write_text(_valid_entry_json()[:-1] + ", " + '"pad": "' + "x" * 2**20 + '"}')
    with pytest.warns(UserWarning, match=r"discarding the invalid batch-size cache entry .*larger than 65,536 bytes"):
        assert read_entry(path, budget=1000) is None
    assert not path.exists()  # a regular file in the cache folder: removed, as a damaged entry is


@pytest.mark.parametrize("kind", ["symlink", "FIFO"])
def test_find_batch_size_never_reads_removes_or_writes_through_a_planted_entry(llama, tmp_path, kind):
    """The entry's file replaced by a link to a file elsewhere, or by a FIFO: the search runs again,
    the thing planted stays as it was, and the file the link points to is untouched by the write."""
    model, opt = llama
    first = find(model, opt, tmp_path)
    path = tmp_path / "batch_size" / first.cache_file.rsplit("/", 1)[-1]
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours to read or write")
    path.unlink()
    if kind == "FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to(outside)
    again, said = _in_thread(lambda: find(model, opt, tmp_path), fifo=path if kind == "FIFO" else None)
    assert again.cache == "miss" and again.batch_size == first.batch_size
    assert any(f"entry {path} is a" in w and "not read" in w for w in said), said
    assert any("the result is returned but not cached" in w for w in said), said
    assert outside.read_text() == "not yours to read or write"
    assert path.is_symlink() if kind == "symlink" else stat.S_ISFIFO(path.lstat().st_mode)


def _snapshot(folder):
    """The mode, listing, and each file's mode and bytes of ``folder`` (or of the file ``folder``)."""
    if folder.is_file():
        return stat.S_IMODE(folder.stat().st_mode), folder.read_bytes()
    files = sorted(folder.iterdir())
    return stat.S_IMODE(folder.stat().st_mode), [
        (f.name, stat.S_IMODE(f.stat().st_mode), f.read_bytes()) for f in files
    ]


@pytest.mark.parametrize("target", ["folder", "file"])
def test_a_planted_cache_folder_link_is_never_chmod_read_written_or_emptied(llama, tmp_path, target):
    """``<cache_dir>/batch_size`` is the finder's own folder: a symlink planted there (to a folder
    holding a junk entry under the job's name, or to a file) leaves its target as it was - mode,
    listing, bytes - and the search still returns the right size, uncached."""
    model, opt = llama
    reference = find(model, opt, tmp_path / "clean")
    name = reference.cache_file.rsplit("/", 1)[-1]
    outside = tmp_path / "outside"
    if target == "folder":
        outside.mkdir(mode=0o755)
        outside.chmod(0o755)
        (outside / name).write_text("junk, not an entry")
        (outside / "other.txt").write_text("someone's file")
    else:
        outside.write_text("someone's file")
        outside.chmod(0o644)
    before = _snapshot(outside)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / "batch_size").symlink_to(outside)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = find(model, opt, cache_dir)
    said = [str(w.message) for w in caught]
    assert result.batch_size == reference.batch_size and result.cache == "miss"
    assert _snapshot(outside) == before
    assert any(f"cache folder {cache_dir / 'batch_size'} is a symlink to {outside}" in w for w in said), said
    assert (cache_dir / "batch_size").is_symlink()


def test_a_forged_self_consistent_entry_never_runs_a_size_its_peak_cannot_hold(llama, tmp_path):
    """An entry consistent in every field (one step at 60000 that 'fitted' just under the budget)
    claims less than 12 MiB / 60000 = 210 bytes a sample - less than the batch's own token ids:
    discarded before make_batch is asked for 60000 (the check step used to run it: 10.8 GB of
    host memory on a 20 MiB budget), and the search finds the measured size again."""
    model, opt = llama
    first = find(model, opt, tmp_path)
    path = tmp_path / "batch_size" / first.cache_file.rsplit("/", 1)[-1]
    peak = parse_bytes(BUDGET) - 1
    forged = {"batch_size": 60000, "peak_bytes": peak, "bytes_per_sample": 1, "capped": False}
    path.write_text(json.dumps({**forged, "steps": [{"batch_size": 60000, "peak_bytes": peak, "fits": True}]}))
    asked = []

    def make(n):
        asked.append(n)
        return batches()(n)

    with pytest.warns(UserWarning, match=f"discarding the batch-size cache entry {path}: batch_size=60000 with"):
        again = find(model, opt, tmp_path, make=make)
    assert max(asked) < 60000 and again.cache == "miss" and again.batch_size == first.batch_size
    assert json.loads(path.read_text())["batch_size"] == first.batch_size
