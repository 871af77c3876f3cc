"""Issue 10: the bundles of one multi-rank step. The parts here are the sample trace rewritten with
rank fields (what a TP recording writes), so the set logic — siblings, missing ranks, parts of
another step, untrusted rank fields, where each rank's bundle goes — is tested without an engine;
tests/e2e/test_multirank.py records and replays real TP=2 sets."""

import shutil

import pytest
from rank_set_forge import SAMPLE, make_set

from tracekit.errors import BundleError
from tracekit.format.rankset import find_rank_set, read_part
from tracekit.format.rewrite import rewrite_bundle
from tracekit.record.persist import OutputTemplate


def test_a_bundle_without_rank_fields_is_a_set_of_one():
    found = find_rank_set(SAMPLE)
    assert read_part(SAMPLE).parallel.world_size == 1
    assert found.complete and found.parts == {0: SAMPLE}


def test_any_part_finds_every_sibling(tmp_path):
    parts = make_set(tmp_path)
    for part in parts:
        found = find_rank_set(part)
        assert found.complete, found.to_plain()
        assert found.parts == dict(enumerate(parts))


def test_a_missing_rank_is_named_with_where_it_was_expected(tmp_path):
    rank0, rank1 = make_set(tmp_path)
    rank1.unlink()
    found = find_rank_set(rank0)
    assert found.missing == [1]
    with pytest.raises(BundleError, match=r"rank 1 \(expected at .*step3\.rank1\.zst\) is missing"):
        found.require_complete()


def test_a_renamed_sibling_is_found_in_the_same_folder(tmp_path):
    rank0, rank1 = make_set(tmp_path)
    rank1.rename(tmp_path / "renamed.zst")
    found = find_rank_set(rank0)
    assert found.complete and found.parts[1] == tmp_path / "renamed.zst"


def test_a_part_of_another_step_at_a_siblings_path_is_refused(tmp_path):
    (tmp_path / "later").mkdir()
    rank0, rank1 = make_set(tmp_path)
    later = make_set(tmp_path / "later", step=4)
    shutil.copy(later[1], rank1)  # rank 1 of step 4 where step 3's rank 1 belongs
    found = find_rank_set(rank0)
    assert not found.complete
    with pytest.raises(BundleError, match="do not belong together: .* holds rank 1 of step 4"):
        found.require_complete()


def test_a_part_of_another_session_is_not_taken_for_a_sibling(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    rank0, _ = make_set(tmp_path / "a", set_id="session-a")
    _, other_rank1 = make_set(tmp_path / "b", set_id="session-b")
    shutil.copy(other_rank1, tmp_path / "a" / "step3.rank1.zst")
    with pytest.raises(BundleError, match="session session-b"):
        find_rank_set(rank0).require_complete()


@pytest.mark.parametrize("field, value", [
    ("rank", 2),  # not below the world size
    ("world_size", 3),  # not TP x PP
    ("world_size", "two"),
    ("parts", ["a", "b", "c"]),  # more parts than ranks
])
def test_bad_rank_fields_are_bad_input(tmp_path, field, value):
    rank0, _ = make_set(tmp_path)

    def damage(metadata, tensors):
        metadata["parallel"][field] = value

    with pytest.raises(BundleError, match=r"bundle content: bundle\.parallel"):
        read_part(rewrite_bundle(rank0, tmp_path / "bad.zst", damage))


def test_each_rank_gets_its_own_path_without_a_rank_placeholder(tmp_path):
    template = OutputTemplate(tmp_path / "step{step}.zst", world_size=2)
    assert template.path_for(3, 1) == tmp_path / "step3.rank1.zst"
    assert template.path_for(3, 0) != template.path_for(3, 1)
    assert OutputTemplate(tmp_path / "step{step}.zst").path_for(3) == tmp_path / "step3.zst"  # one rank: as given
    explicit = OutputTemplate(str(tmp_path / "r{rank}-step{step}.tk.zst"), world_size=2)
    assert explicit.path_for(5, 1) == tmp_path / "r1-step5.tk.zst"
