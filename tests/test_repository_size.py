"""Every clone downloads the tree: nothing over 1 MB is tracked unless it is named here with its reason."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).parents[1]
LIMIT = 1_000_000  # bytes

# path -> why it is in the tree; each entry also caps the file's size, so a larger replacement is seen.
ALLOWED = {
    "eagle3_hf/drafts/smollm2-135m-instruct/model.safetensors": (
        "the shipped draft and the lineage's resume point",
        30_000_000,
    ),
}


def _tracked_sizes() -> dict[str, int]:
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    names = [n for n in listing.stdout.decode().split("\0") if n]
    return {n: (ROOT / n).stat().st_size for n in names if (ROOT / n).is_file()}


def oversized(sizes: dict[str, int], allowed: dict[str, tuple[str, int]]) -> list[str]:
    """The files over `LIMIT` that `allowed` does not name, or that exceed their own cap."""
    found = []
    for name, size in sorted(sizes.items()):
        if size <= LIMIT:
            continue
        if name not in allowed:
            found.append(f"{name} ({size:,} bytes): over {LIMIT:,} and not in ALLOWED")
        elif size > allowed[name][1]:
            found.append(f"{name} ({size:,} bytes): over its cap of {allowed[name][1]:,}")
    return found


def test_no_tracked_file_over_one_megabyte_but_the_named_ones():
    assert oversized(_tracked_sizes(), ALLOWED) == []


def test_the_check_catches_a_new_large_file_and_a_grown_allowed_one():
    sizes = {"small.txt": 10, "data/corpus.safetensors": 5_000_000, "draft.safetensors": 3_000_000}
    allowed = {"draft.safetensors": ("shipped", 2_000_000)}
    found = oversized(sizes, allowed)
    assert len(found) == 2 and "data/corpus.safetensors" in found[0] and "over its cap" in found[1]


def test_every_allowed_file_is_still_tracked():
    # A stale entry would let a future file of that name in unseen.
    sizes = _tracked_sizes()
    assert [name for name in ALLOWED if name not in sizes] == []
