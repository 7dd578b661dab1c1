"""Shard layout: rows per rank as DTensor splits them, equal aligned shard buffers, bit-exact
gather and copy-out, reduce-scatter input with flags, JSON, unit grouping."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from lamina.errors import ConfigError
from lamina.memory import ROOT_UNIT, ShardLayout, UnitLayout, build_layout, group_units

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Params(nn.Module):
    """A bare module holding parameters ``p0, p1, ...`` filled with random bit patterns
    (NaNs, infinities and subnormals included)."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for i, (shape, dtype) in enumerate(specs):
            bits = BITS[dtype.itemsize]
            info = torch.iinfo(bits)
            raw = torch.randint(info.min, info.max, shape, dtype=bits, generator=gen)
            self.register_parameter(f"p{i}", nn.Parameter(raw.view(dtype)))


param_specs = st.lists(
    st.tuples(
        st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=6,
)
world_sizes = st.integers(1, 8)
alignments = st.sampled_from([2, 4, 8, 64, 512, 4096])


def _layout(
    specs: list[tuple[tuple[int, ...], torch.dtype]], world: int, alignment: int, seed: int = 0
) -> tuple[Params, ShardLayout]:
    model = Params(specs, seed)
    # float32 needs alignment >= 4: raise the drawn alignment to the largest element
    alignment = max(alignment, *(d.itemsize for _, d in specs))
    return model, build_layout(model, world, alignment_bytes=alignment)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _torch_local_shapes(shape: tuple[int, ...], world: int) -> list[tuple[int, ...]]:
    """The local shapes ``DTensor`` ``Shard(0)`` gives each rank (``torch.chunk`` rows,
    empty shards for the ranks past the last chunk); a 0-dim tensor is replicated."""
    if not shape:
        return [()] * world
    chunks = [tuple(c.shape) for c in torch.empty(shape).chunk(world, 0)]
    return chunks + [(0, *shape[1:])] * (world - len(chunks))


@settings(max_examples=300, deadline=None)
@given(specs=param_specs, world=world_sizes, alignment=alignments)
def test_shards_are_equal_sized_aligned_and_tile_the_buffer(
    specs: list[tuple[tuple[int, ...], torch.dtype]], world: int, alignment: int
) -> None:
    """Every rank's shard buffer has the same aligned size; each parameter's chunk is
    ``ceil(dim0 / W)`` rows at a fixed offset, chunks follow each other, and the local
    shards have exactly the shapes DTensor's ``Shard(0)`` gives each rank."""
    _, layout = _layout(specs, world, alignment)
    assert sorted(layout.param_names) == sorted(f"p{i}" for i in range(len(specs)))
    for unit in layout.units:
        assert unit.total_numel == unit.shard_numel * world
        assert unit.shard_numel * unit.element_size % layout.alignment_bytes == 0
        cursor = 0
        for p in unit.params:
            assert p.offset == cursor and p.numel == math.prod(p.shape)
            assert p.rows == (1 if not p.shape else -(-p.shape[0] // world))
            cursor += p.chunk
            assert [p.local_shape(r) for r in range(world)] == _torch_local_shapes(p.shape, world)
        assert unit.flag_offset == cursor
        # room for one used-flag per parameter, and no more padding than alignment needs
        slack = unit.shard_numel - cursor - len(unit.params)
        assert 0 <= slack < layout.alignment_bytes // unit.element_size
    assert layout.bytes_per_rank() == sum(u.shard_numel * u.element_size for u in layout.units)


@settings(max_examples=300, deadline=None)
@given(specs=param_specs, world=world_sizes, alignment=alignments, seed=st.integers(0, 2**31 - 1))
@example(  # zero-size and 0-dim parameters, a unit split by dtype, fewer rows than ranks
    specs=[
        ((0, 3), torch.float32),
        ((), torch.bfloat16),
        ((4,), torch.float32),
        ((1, 2), torch.float16),
    ],
    world=3,
    alignment=4,
    seed=3,
)
def test_padding_is_zero_and_gathered_shards_reproduce_parameters_bit_exactly(
    specs: list[tuple[tuple[int, ...], torch.dtype]], world: int, alignment: int, seed: int
) -> None:
    """Each rank's shard buffer holds its rows (bit-exact, NaNs and all) and zeros
    elsewhere; what an all-gather hands back, copied out, gives every parameter back."""
    model, layout = _layout(specs, world, alignment, seed)
    params = dict(model.named_parameters())
    for unit in layout.units:
        shards = [unit.shard_of(params, r) for r in range(world)]
        for rank, shard in enumerate(shards):
            assert shard.dtype == unit.torch_dtype and shard.shape == (unit.shard_numel,)
            covered = torch.zeros(unit.shard_numel, dtype=torch.bool)
            locals_ = unit.local_views(shard, rank)
            for p in unit.params:
                covered[p.offset : p.offset + p.local_numel(rank)] = True
                rows = params[p.name] if p.replicated else params[p.name].chunk(world, 0)
                expected = rows if p.replicated or rank >= len(rows) else rows[rank]
                if not p.replicated and rank >= len(rows):
                    expected = params[p.name][:0]
                assert torch.equal(_raw(locals_[p.name]), _raw(expected))
            assert not _raw(shard[~covered]).any(), "row padding and flags must be zero"
        gathered = torch.cat([s.clone() for s in shards])  # an all-gather's result
        unsharded = unit.copy_out(
            gathered, torch.empty(unit.unsharded_numel, dtype=unit.torch_dtype)
        )
        for name, view in unit.views(unsharded).items():
            assert view.shape == params[name].shape and view.dtype == params[name].dtype
            assert torch.equal(_raw(view), _raw(params[name]))


@settings(max_examples=100, deadline=None)
@given(specs=param_specs, world=world_sizes, alignment=alignments, seed=st.integers(0, 2**31 - 1))
def test_reduce_scatter_input_gives_each_rank_its_rows_of_the_sum_and_every_flag(
    specs: list[tuple[tuple[int, ...], torch.dtype]], world: int, alignment: int, seed: int
) -> None:
    """Summing every rank's scatter input slot by slot (what a reduce-scatter does) leaves
    each rank its rows of the summed gradients and, in every slot, the number of ranks
    that used each parameter; a replicated parameter's sum reaches every rank."""
    _, layout = _layout(specs, world, alignment, seed)
    gen = torch.Generator().manual_seed(seed)
    for unit in layout.units:
        grads = [
            {p.name: torch.randint(-8, 8, p.shape, generator=gen).float() for p in unit.params}
            for _ in range(world)
        ]
        used = [
            [bool((r + k) % 2) or r == 0 for k in range(len(unit.params))] for r in range(world)
        ]
        total = torch.zeros(unit.total_numel)
        for rank in range(world):
            grad = torch.zeros(unit.unsharded_numel)
            for name, view in unit.views(grad).items():
                view.copy_(grads[rank][name])
            total += unit.scatter_input(grad, torch.tensor(used[rank], dtype=torch.float32))
        slots = total.view(world, unit.shard_numel)
        for rank in range(world):
            locals_ = unit.local_views(slots[rank].contiguous(), rank)
            for p in unit.params:
                summed = sum(g[p.name] for g in grads)
                rows = summed.reshape(p.shape)
                expected = rows if p.replicated else rows[rank * p.rows : rank * p.rows + p.rows]
                assert torch.equal(locals_[p.name], expected.reshape(p.local_shape(rank)))
            flags = slots[rank, unit.flag_offset : unit.flag_offset + len(unit.params)]
            assert flags.tolist() == [sum(u[k] for u in used) for k in range(len(unit.params))]


@settings(max_examples=100, deadline=None)
@given(specs=param_specs, world=world_sizes, alignment=alignments)
def test_layout_json_round_trip_and_fingerprint_are_stable(
    specs: list[tuple[tuple[int, ...], torch.dtype]], world: int, alignment: int
) -> None:
    model, layout = _layout(specs, world, alignment)
    data = json.loads(json.dumps(layout.to_json()))
    again = ShardLayout.from_json(data)
    assert again == layout
    assert again.fingerprint() == layout.fingerprint()
    rebuilt = build_layout(model, world, alignment_bytes=layout.alignment_bytes)
    assert rebuilt.fingerprint() == layout.fingerprint()
    other = build_layout(model, world + 1, alignment_bytes=layout.alignment_bytes)
    assert other.fingerprint() != layout.fingerprint()


def test_shard_of_into_a_given_buffer_clears_stale_padding() -> None:
    model = Params([((3,), torch.float32), ((2, 2), torch.float32)], seed=1)
    (unit,) = build_layout(model, 3, alignment_bytes=16).units
    assert [(p.offset, p.rows) for p in unit.params] == [(0, 1), (1, 1)]
    assert unit.shard_numel == 8  # 1 + 2 elements of rows, 2 flags, rounded up to 16 bytes
    out = torch.full((unit.shard_numel,), 7.0)
    shard = unit.shard_of(dict(model.named_parameters()), 2, out=out)
    assert shard is out
    # rank 2: p0's third element; p1 has two rows, none for rank 2
    assert out[0].item() == model.p0[2].item() and not out[1:].any()
    with pytest.raises(ConfigError, match="1-D tensor of 8 elements"):
        unit.shard_of(dict(model.named_parameters()), 0, out=torch.zeros(11))


def test_shard_of_rejects_missing_or_misshapen_tensors() -> None:
    model = Params([((3,), torch.float32), ((2,), torch.float32)], seed=1)
    (unit,) = build_layout(model, 2).units
    with pytest.raises(ConfigError, match=r"no tensor given for parameters \['p1'\]"):
        unit.shard_of({"p0": torch.zeros(3)}, 0)
    with pytest.raises(ConfigError, match="'p1' has shape"):
        unit.shard_of({"p0": torch.zeros(3), "p1": torch.zeros(5)}, 0)
    with pytest.raises(ConfigError, match="outside world size"):
        unit.shard_of(dict(model.named_parameters()), 2)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight


def test_gpt_gives_one_unit_per_block_plus_root_with_the_tied_weight_once() -> None:
    model = TinyGPT()
    units = group_units(model, min_unit_numel=0)
    assert [u for u, _ in units] == [ROOT_UNIT, "blocks.0", "blocks.1", "blocks.2"]
    root = dict(units)[ROOT_UNIT]
    assert root == ["embed.weight", "ln_f.weight", "ln_f.bias"]
    assert dict(units)["blocks.1"][0] == "blocks.1.ln.weight"
    layout = build_layout(model, 4, units=units)
    names = layout.param_names
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert "head.weight" not in names and layout.unit_of("embed.weight").name == ROOT_UNIT
    assert layout.unit_of("blocks.2.mlp.2.bias").name == "blocks.2"
    with pytest.raises(KeyError, match=r"head\.weight"):
        layout.unit_of("head.weight")
    table = layout.table()
    assert "blocks.1" in table and "padding" in table and "4 unit(s)" in table


def test_small_blocks_merge_forward_and_a_small_tail_joins_the_group_before() -> None:
    model = TinyGPT()  # each block: 32 + 544 + 528 = 1104 elements
    units = group_units(model, min_unit_numel=2000)
    assert [u for u, _ in units] == [ROOT_UNIT, "blocks.0..blocks.2"]
    assert [u for u, _ in group_units(model, min_unit_numel=1000)][1:] == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
    ]
    assert [u for u, _ in group_units(model)] == [ROOT_UNIT, "blocks.0..blocks.2"]


def test_model_without_a_module_list_is_one_root_unit() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

    units = group_units(Flat(), min_unit_numel=0)
    assert units == [(ROOT_UNIT, ["a.weight", "a.bias", "b.weight", "b.bias"])]


def test_frozen_parameters_are_grouped_like_the_others_and_unit_types_pick_units() -> None:
    model = TinyGPT()
    model.embed.weight.requires_grad_(False)
    units = dict(group_units(model, min_unit_numel=0, unit_types=(nn.Linear,)))
    assert "embed.weight" in units[ROOT_UNIT]  # sharded like a trained one (as FSDP2 does)
    assert "blocks.0.mlp.0" in units and "blocks.0.ln.weight" in units[ROOT_UNIT]
    for block in model.blocks:  # a block of frozen parameters only is still a unit
        block.requires_grad_(False)
    names = [u for u, _ in group_units(model, min_unit_numel=0)]
    assert names == [ROOT_UNIT, "blocks.0", "blocks.1", "blocks.2"]


def test_a_unit_with_mixed_dtypes_is_split_by_dtype() -> None:
    model = TinyGPT(depth=1)
    model.blocks[0].mlp.to(torch.bfloat16)
    layout = build_layout(model, 2, units=group_units(model, min_unit_numel=0))
    assert [u.name for u in layout.units] == [
        ROOT_UNIT,
        "blocks.0[float32]",
        "blocks.0[bfloat16]",
    ]
    assert [u.dtype for u in layout.units[1:]] == ["float32", "bfloat16"]
    assert [u.index for u in layout.units] == [0, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an integer >= 1"),
        ({"alignment_bytes": 48}, "must be a power of two"),
        ({"alignment_bytes": 2}, "smaller than the 4-byte elements"),
        ({"units": [("u", ["nope"])]}, r"does not have: \['nope'\]"),
        ({"units": [("u", ["a.weight"]), ("v", ["a.weight"])]}, "in two units"),
        ({"units": [("u", ["b.weight"])]}, "tied alias of 'a.weight'"),
    ],
)
def test_bad_settings_are_one_line_config_errors(kwargs: dict[str, object], message: str) -> None:
    model = nn.Module()
    model.a = nn.Linear(4, 4)
    model.b = nn.Linear(4, 4)
    model.b.weight = model.a.weight
    args: dict[str, object] = {"world_size": 2, **kwargs}
    with pytest.raises(ConfigError, match=message) as err:
        build_layout(model, **args)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_inconsistent_layout_json_is_rejected() -> None:
    layout = build_layout(TinyGPT(), 2, units=[("u", ["blocks.0.ln.weight"])])
    data = layout.to_json()
    data["units"][0]["shard_numel"] += 1
    with pytest.raises(ConfigError, match="does not hold its chunks and flags"):
        ShardLayout.from_json(data)
    data = layout.to_json()
    data["units"][0]["params"][0]["offset"] = 3
    with pytest.raises(ConfigError, match="bad offset or row split"):
        ShardLayout.from_json(data)
    data = layout.to_json()
    data["units"][0]["params"][0]["rows"] = 16
    with pytest.raises(ConfigError, match="bad offset or row split"):
        ShardLayout.from_json(data)
    with pytest.raises(ConfigError, match="malformed"):
        ShardLayout.from_json({"version": 2, "units": [{}]})
    with pytest.raises(ConfigError, match="version"):
        ShardLayout.from_json({"units": []})


def test_unit_pack_needs_no_model() -> None:
    unit = UnitLayout.pack(0, "u", torch.bfloat16, [("w", (5, 3)), ("b", (5,))], 4, 64)
    # 2 rows per rank of each: w 6 elements, b 2, then 2 flags, rounded to 32 bf16
    assert [(p.offset, p.rows, p.full_offset) for p in unit.params] == [(0, 2, 0), (6, 2, 24)]
    assert unit.shard_numel == 32 and unit.unsharded_numel == 32
    assert unit.padding == 128 - 20 and unit.param_numel == 20
