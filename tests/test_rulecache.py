"""The rule cache: a hit returns the same rules without parsing; anything odd is a miss."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from fusectl import rulecache, rulefile
from fusectl.compile import CompiledRule

RULE = """\
version: 1
rules:
  - id: relu-twice
    summary: Relu(Relu(x)) is Relu(x); saves one pass over the tensor.
    match:
      - y = Relu(x)
      - z = Relu(y)
    where:
      - expr: rank(x) >= 1
        message: x must not be a scalar
    replace:
      - z = Relu(x)
    tests:
      - name: fires
        model: |
          <ir_version: 8, opset_import: ["" : 17]>
          g (float[2] x) => (float[2] z) { y = Relu(x)  z = Relu(y) }
        expect: {fires: 1}
      - name: single relu does not fire
        model: |
          <ir_version: 8, opset_import: ["" : 17]>
          g (float[2] x) => (float[2] z) { z = Relu(x) }
        expect: {fires: 0}
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(rulecache.CACHE_ENV, str(folder))
    monkeypatch.delenv(rulecache.DISABLE_ENV, raising=False)
    return folder


def _rule_file(tmp_path: Path, text: str = RULE) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return path


def _no_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed although the cache holds this file")

    monkeypatch.setattr(rulefile, "load_rule_text", refuse)


def test_a_second_load_comes_from_the_cache(cache: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = _rule_file(tmp_path)
    first = rulefile.load_rule_file(path)
    assert len(list(cache.glob("*.pickle"))) == 1
    _no_parsing(monkeypatch)
    second = rulefile.load_rule_file(path)
    assert second == first
    assert second[0].where == first[0].where
    # The cached rule still compiles and its expressions still parse lazily.
    assert CompiledRule(second[0]).root_ops == frozenset({("", "Relu")})


def test_an_edited_file_is_parsed_again(cache: Path, tmp_path: Path) -> None:
    path = _rule_file(tmp_path)
    rulefile.load_rule_file(path)
    path.write_text(RULE.replace("relu-twice", "relu-relu"))
    assert [r.id for r in rulefile.load_rule_file(path)] == ["relu-relu"]
    assert len(list(cache.glob("*.pickle"))) == 2


def test_a_broken_file_is_reported_every_time_and_not_cached(cache: Path,
                                                             tmp_path: Path) -> None:
    path = _rule_file(tmp_path, RULE.replace("version: 1", "version: 7"))
    for _ in range(2):
        with pytest.raises(rulefile.RuleFileError, match="unsupported version"):
            rulefile.load_rule_file(path)
    assert not list(cache.glob("*.pickle"))


def test_the_cache_can_be_turned_off(cache: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rulecache.DISABLE_ENV, "1")
    rulefile.load_rule_file(_rule_file(tmp_path))
    assert not cache.exists()


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() == 0,
                    reason="root may write anywhere")
def test_an_unwritable_cache_folder_means_no_cache(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o500)
    monkeypatch.setenv(rulecache.CACHE_ENV, str(folder))
    assert [r.id for r in rulefile.load_rule_file(_rule_file(tmp_path))] == ["relu-twice"]


def test_a_shared_cache_folder_is_not_used(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv(rulecache.CACHE_ENV, str(folder))
    assert rulecache.cache_dir() is None
    assert [r.id for r in rulefile.load_rule_file(_rule_file(tmp_path))] == ["relu-twice"]
    assert not list(folder.iterdir())


def test_builtin_root_ops_match_the_compiled_patterns() -> None:
    """The rewrite loop skips rules by root_ops, computed without compiling: it must name
    exactly the ops the compiled pattern variants are rooted at."""
    for rule in rulefile.load_builtin_rules():
        compiled = CompiledRule(rule)
        assert compiled.root_ops == frozenset(compiled.variants_by_root), rule.id


def _cached_entry(cache: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A rule file, loaded once, and its cache entry."""
    path = _rule_file(tmp_path)
    rulefile.load_rule_file(path)
    (entry,) = cache.glob("*.pickle")
    return path, entry


def _planted_rules() -> bytes:
    """A pickle of valid rules with another id: read, it would replace the file's rules."""
    return pickle.dumps(rulefile.load_rule_text(RULE.replace("relu-twice", "planted"), "x.yaml"))


def _ids(path: Path) -> list[str]:
    return [rule.id for rule in rulefile.load_rule_file(path)]


def test_a_private_entry_is_what_is_read(cache: Path, tmp_path: Path) -> None:
    """The control for the tests below: a private entry is used as it is."""
    path, entry = _cached_entry(cache, tmp_path)
    entry.write_bytes(_planted_rules())
    assert _ids(path) == ["planted"]


def test_an_entry_others_may_write_is_not_read(cache: Path, tmp_path: Path) -> None:
    """Someone else's pickle would run their code: a group-writable entry is ignored."""
    path, entry = _cached_entry(cache, tmp_path)
    entry.write_bytes(_planted_rules())
    entry.chmod(0o664)
    assert _ids(path) == ["relu-twice"]


def test_a_symlinked_entry_is_not_followed(cache: Path, tmp_path: Path) -> None:
    path, entry = _cached_entry(cache, tmp_path)
    elsewhere = tmp_path / "elsewhere.pickle"
    elsewhere.write_bytes(_planted_rules())
    elsewhere.chmod(0o600)
    entry.unlink()
    entry.symlink_to(elsewhere)
    assert _ids(path) == ["relu-twice"]


@pytest.mark.parametrize("payload", [b"\x80\x05not a pickle", pickle.dumps(["planted"])],
                         ids=["corrupt", "not-rules"])
def test_an_unusable_entry_is_a_miss(cache: Path, tmp_path: Path, payload: bytes) -> None:
    path, entry = _cached_entry(cache, tmp_path)
    entry.write_bytes(payload)
    assert _ids(path) == ["relu-twice"]
