"""A tier's identity (kv_tiers/identity.py): it follows the model's weight files and the
layout, not other files; a block's tier key is 63 bits and differs for another identity."""

from __future__ import annotations

from parashift.kv_tiers.identity import tier_identity, tier_key


def identity(model, **changes) -> bytes:
    args = dict(dtype="bfloat16", block_size=16, layout="tp1-pp1", worker_block_bytes=4096,
                num_workers=1) | changes
    return tier_identity(str(model), **args)


def test_tier_identity_follows_the_model_files_and_the_layout(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"\0" * 100)
    (model / "README.md").write_text("not a weight")
    base = identity(model)
    assert len(base) == 32 and identity(model) == base
    (model / "README.md").write_text("not a weight, and longer")
    assert identity(model) == base
    for change in (dict(dtype="float16"), dict(block_size=32), dict(layout="tp2-pp1"),
                   dict(worker_block_bytes=8192), dict(num_workers=2)):
        assert identity(model, **change) != base, change
    (model / "model.safetensors").write_bytes(b"\0" * 101)
    assert identity(model) != base


def test_tier_key_is_63_bits_and_differs_for_another_identity():
    one, other = bytes(32), bytes([1]) + bytes(31)
    for block_hash in (0, 1, 2**63 - 1, -(2**63)):
        key = tier_key(one, block_hash)
        assert 0 <= key < 2**63 and key == tier_key(one, block_hash)
        assert key != tier_key(other, block_hash)
    assert tier_key(one, 1) != tier_key(one, 2)
