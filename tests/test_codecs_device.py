"""Codecs and the engine on any device: the same bytes everywhere, only encoded bytes copied.

On the CPU the device-generic path is exercised through ``CopyStaging("cpu")``:
every copy a GPU site makes (to reused host buffers and back), without the
streams. The CUDA tests check the contract that matters across mixed sites:
a CUDA codec writes the CPU codec's bytes, and decodes them to the same bits.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from isthmus.inter.allreduce import CrossSiteAllReduce
from isthmus.inter.codecs import BLOCKWISE_LEVELS, LOSSY, CodecError, ErrorFeedback, parse_codec
from isthmus.inter.peer import Identity
from isthmus.inter.staging import HOST, CopyStaging, staging_for

SPECS = [*LOSSY, *(f"{name}+zstd" for name in LOSSY)]
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a GPU: CUDA codec bytes against the CPU codec's, pinned staging",
)


def _pattern(n: int) -> torch.Tensor:
    """Values made by exact integer arithmetic and one IEEE division: the same on
    every machine, so their encodings can be pinned down by hash."""
    i = torch.arange(n, dtype=torch.int64)
    v = ((i * 7919 + 13) % 2001 - 1000).to(torch.float32) / 37.0
    v[256:512] *= 0.001
    v[512:768] *= 1e-30
    v[768:1024] *= 300.0
    return v


# sha256[:16] of the payload, taken with the codec as it was before it ran on
# devices (commit 8a6e320): the device-generic path must not change a byte.
BEFORE = {
    ("none", 0, 256): "e3b0c44298fc1c14", ("none", 3, 256): "52d12004d9e87619",
    ("none", 1100, 256): "277c9714efd30c5e", ("fp16", 0, 256): "e3b0c44298fc1c14",
    ("fp16", 3, 256): "31f9abfa8c87045f", ("fp16", 1100, 256): "48eb9958614705be",
    ("bf16", 0, 256): "e3b0c44298fc1c14", ("bf16", 3, 256): "b745fabb028feead",
    ("bf16", 1100, 256): "c96314ac590a6a71", ("int8", 0, 256): "9c0095c04ef53d9d",
    ("int8", 0, 64): "1751ac12e70e15b4", ("int8", 3, 256): "e5b4310c2c885e18",
    ("int8", 3, 64): "1e52a9c7f71371bf", ("int8", 1100, 256): "449b6cf0a41229ca",
    ("int8", 1100, 64): "5ee62ce669ce66bd", ("int4", 0, 256): "5ff8a4cd267bfa79",
    ("int4", 0, 64): "f6c5b425daf2fbc0", ("int4", 3, 256): "36d8bfa8c36175fc",
    ("int4", 3, 64): "16436ee481621c9e", ("int4", 1100, 256): "59b2db26700fae8f",
    ("int4", 1100, 64): "df5c70b87b4391ff", ("int2", 0, 256): "06ea3e5f982a4b59",
    ("int2", 0, 64): "468794c01ac284d4", ("int2", 3, 256): "db7452c4a69d1036",
    ("int2", 3, 64): "2e81ee9002abc4bf", ("int2", 1100, 256): "0cfaa2699b610b5d",
    ("int2", 1100, 64): "3d31300b93da46aa",
}  # fmt: skip


def _digest(payload) -> str:
    return hashlib.sha256(bytes(payload)).hexdigest()[:16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().view(torch.int32)


@pytest.mark.parametrize(("name", "n", "block_size"), sorted(BEFORE))
def test_the_device_generic_path_gives_the_bytes_of_before(name, n, block_size):
    codec = parse_codec(name, block_size=block_size)
    values = _pattern(n)
    assert _digest(codec.encode(values).payload) == BEFORE[(name, n, block_size)]
    copied = codec.encode(values, staging=CopyStaging("cpu"))
    assert _digest(copied.payload) == BEFORE[(name, n, block_size)]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [0, 1, 255, 257, 70_001])
def test_copy_staging_encodes_and_decodes_like_the_host(spec, n):
    codec = parse_codec(spec)
    values = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 5
    staging = CopyStaging("cpu")
    here, copied = codec.encode(values), codec.encode(values, staging=staging)
    assert bytes(here.payload) == bytes(copied.payload)
    assert here.meta == copied.meta
    out = torch.full((n + 10,), 7.0)
    decoded = codec.decode(copied, out=out[5 : 5 + n], staging=staging)
    assert torch.equal(_bits(decoded), _bits(codec.decode(here)))
    assert torch.equal(out[:5], torch.full((5,), 7.0)) and torch.equal(out[-5:], out[:5])


def test_host_staging_copies_nothing():
    raw = HOST.empty(16)
    raw.fill_(3)
    payload = HOST.to_host(raw)
    raw[0] = 9  # the payload is the tensor's own memory
    assert bytes(payload)[0] == 9
    data = b"\x01\x02\x03\x04"
    (tensor,) = HOST.to_device([data])
    assert tensor.tolist() == [1, 2, 3, 4]
    assert staging_for("cpu") is HOST


def test_copy_staging_copies_only_encoded_bytes_and_packs_parts_aligned():
    staging = CopyStaging("cpu")
    codec = parse_codec("int8")
    values = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    encoded = codec.encode(values, staging=staging)
    codec.decode(encoded, staging=staging)
    assert staging.bytes_to_host == len(encoded.payload) < values.numel() * 4 // 3
    assert staging.bytes_to_device < len(encoded.payload) + 2 * 64
    scales, body = staging.to_device([b"\x00\x00\x80\x3f", bytes(range(5))])
    assert scales.view(torch.float32).item() == 1.0
    assert body.tolist() == [0, 1, 2, 3, 4]
    assert scales.storage_offset() % 64 == 0 and body.storage_offset() % 64 == 0


def test_an_all_zero_block_has_a_positive_zero_scale_on_every_path():
    """A kernel may return -0 as the max of zeros (the CPU's did, by vector lane):
    a -0 scale decodes its block to -0, and two devices would disagree in the sign."""
    values = torch.cat([torch.full((64,), -0.0), torch.zeros(64), torch.ones(64)])
    for name in BLOCKWISE_LEVELS:
        codec = parse_codec(name, block_size=64)
        for staging in (HOST, CopyStaging("cpu")):
            encoded = codec.encode(values, staging=staging)
            scales = torch.frombuffer(bytearray(encoded.payload[:12]), dtype=torch.int32)
            assert scales[:2].tolist() == [0, 0], name  # +0.0, bit for bit
            decoded = codec.decode(encoded)
            assert torch.equal(_bits(decoded[:128]), torch.zeros(128, dtype=torch.int32))
            assert torch.equal(decoded[128:], torch.ones(64))


def test_a_block_too_small_to_invert_quantises_to_zero_not_garbage():
    """levels / absmax overflows for absmax below ~levels * 3e-39: x * inf would be
    NaN, and NaN's cast to int8 is undefined (each device makes up its own bytes).
    Such a block is sent as zeros: off by less than 1e-36."""
    values = torch.cat([torch.full((64,), 1e-40), torch.full((64,), -3e-38), torch.ones(64)])
    for name in BLOCKWISE_LEVELS:
        codec = parse_codec(name, block_size=64)
        decoded = codec.decode(codec.encode(values))
        assert torch.equal(decoded[:64], torch.zeros(64)), name
        assert (decoded[64:128] - values[64:128]).abs().max() <= 3e-38, name
        assert torch.equal(decoded[128:], torch.ones(64))


def test_the_block_scale_is_one_ieee_division():
    """The contract a CUDA kernel must meet: scale = absmax / levels rounded once
    (CUDA computes ``x / 127`` as ``x * (1/127)``, which can differ in the last bit)."""
    values = torch.randn(256 * 400, generator=torch.Generator().manual_seed(3))
    for name, levels in BLOCKWISE_LEVELS.items():
        encoded = parse_codec(name).encode(values)
        scales = torch.frombuffer(bytearray(encoded.payload[: 4 * 400]), dtype=torch.float32)
        absmax = values.view(400, 256).abs().amax(dim=1)
        assert torch.equal(scales, (absmax.double() / levels).float()), name


def test_a_staging_for_another_device_is_refused():
    with pytest.raises(CodecError, match="cannot move a tensor on cpu"):
        parse_codec("int8").encode(torch.ones(4), staging=CopyStaging("meta"))


def test_error_feedback_keeps_its_residual_on_the_values_device():
    feedback = ErrorFeedback(parse_codec("int4"))
    feedback.encode(torch.linspace(-1, 1, 300))
    assert feedback.residual is not None and feedback.residual.device.type == "cpu"


# -- the engine --------------------------------------------------------------------------
JOB = "device-test"


async def _group(stagings):
    """Connected engines ``site0`` ...; ``stagings[i]``: site i's (None: by device)."""
    names = [f"site{i}" for i in range(len(stagings))]
    members, ports = {}, {}
    for name, staging in zip(names, stagings, strict=True):
        identity = Identity(job=JOB, site=name, rank=0, layout_fingerprint="L")
        members[name] = CrossSiteAllReduce(identity, {}, deadline_s=30.0, staging=staging)
        ports[name] = await members[name].start("127.0.0.1", 0)
    for name, member in members.items():
        member.peers = {o: f"127.0.0.1:{ports[o]}" for o in names if o != name}
        member.server.servicer.sites = set(names)
    for member in members.values():
        await member.connect()
    return names, members


def _exchange(stagings, inputs, codec, algorithm, rounds=2, feedback="model"):
    """Every round's output per site; the same inputs each round (feedback differs)."""

    async def main():
        names, members = await _group(stagings)
        for member in members.values():
            member.codec = parse_codec(codec)
        weights = {s: float(i + 1) for i, s in enumerate(names)}
        outs = []
        try:
            for r in range(rounds):
                got = await asyncio.gather(
                    *[
                        members[s].allreduce(
                            inputs[i],
                            round=r,
                            participants=names,
                            weights=weights,
                            algorithm=algorithm,
                            feedback=feedback,
                        )
                        for i, s in enumerate(names)
                    ]
                )
                outs.append(got)
        finally:
            for member in members.values():
                await member.close()
        return outs

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("codec", "algorithm"),
    [
        ("none", "direct"),
        ("int8", "direct"),
        ("int4+zstd", "direct"),
        ("int2", "ring"),
        # Every site encodes the average itself: the same bits on every path.
        ("int2+zstd", "gather"),
        ("none", "gather"),
    ],
)
def test_sites_staging_through_copies_end_bitwise_identical_to_host_sites(codec, algorithm):
    """Two sites take the path a GPU site takes (every chunk copied out and back),
    one the host path; all end with the same bits, the same as three host sites."""
    generator = torch.Generator().manual_seed(7)
    inputs = [torch.randn(30_011, generator=generator) * (i + 1) for i in range(3)]
    mixed = _exchange([CopyStaging("cpu"), None, CopyStaging("cpu")], inputs, codec, algorithm)
    plain = _exchange([None, None, None], inputs, codec, algorithm)
    for r, outs in enumerate(mixed):
        for out in outs:
            assert torch.equal(_bits(out), _bits(outs[0])), f"round {r}: sites disagree"
            assert torch.equal(_bits(out), _bits(plain[r][0])), f"round {r}: differs from host"


def test_an_engine_refuses_a_tensor_on_another_device_than_its_staging():
    async def main():
        identity = Identity(job=JOB, site="a", rank=0, layout_fingerprint="L")
        member = CrossSiteAllReduce(identity, {}, staging=CopyStaging("meta"))
        await member.start("127.0.0.1", 0)
        try:
            with pytest.raises(ValueError, match="stages for meta"):
                await member.allreduce(
                    torch.ones(8), round=0, participants=["a"], weights={"a": 1.0}
                )
        finally:
            await member.close()

    asyncio.run(main())


@pytest.mark.parametrize("name", sorted(BLOCKWISE_LEVELS))
def test_the_gpus_large_quantisation_steps_write_the_cpus_bytes(name, monkeypatch):
    """A GPU quantises in 128 MiB steps, the CPU in 1 MiB ones (the launches, not the
    arithmetic, cost on a GPU). The step only splits elementwise work, so the CPU run
    with the GPU's step must give the same bytes and decoded bits, partial last
    block and awkward blocks included."""
    from isthmus.inter import codecs

    values, codec = _awkward((1 << 20) + 77, "cpu"), parse_codec(name)
    small = codec.encode(values)
    small_decoded = codec.decode(small)
    monkeypatch.setattr(codecs, "_QUANTIZE_CHUNK_VALUES", codecs._QUANTIZE_CHUNK_VALUES_ACCELERATOR)
    large = codec.encode(values)
    assert bytes(large.payload) == bytes(small.payload)
    assert torch.equal(_bits(codec.decode(large)), _bits(small_decoded))


# -- on a GPU ----------------------------------------------------------------------------
def _awkward(n: int, device: str) -> torch.Tensor:
    """Random values with the blocks where devices could disagree: all zeros, all
    -0.0, too small to invert, subnormal, large; and a partial last block."""
    values = torch.randn(n, generator=torch.Generator().manual_seed(11)) * 3
    values[256:512] = 0.0
    values[512:768] = -0.0
    values[768:1024] *= 1e-39
    values[1024:1280] *= 1e-20
    # large, yet inside fp16's range (65504), which fp16 refuses to leave on any device
    values[1280:1536] = values[1280:1536].clamp(-6.0, 6.0) * 1e4
    return values.to(device)


@needs_gpu
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [3, 1600 + 77, (1 << 20) + 77])
def test_cuda_encode_writes_the_cpu_codecs_bytes_and_decodes_to_its_bits(spec, n):
    codec = parse_codec(spec)
    on_gpu = _awkward(n, "cuda")
    on_cpu = on_gpu.cpu()
    gpu_encoded, cpu_encoded = codec.encode(on_gpu), codec.encode(on_cpu)
    assert bytes(gpu_encoded.payload) == bytes(cpu_encoded.payload)
    assert gpu_encoded.meta == cpu_encoded.meta
    out = torch.empty(n, device="cuda")
    decoded = codec.decode(cpu_encoded, out=out)
    assert decoded.device.type == "cuda"
    assert torch.equal(_bits(decoded), _bits(codec.decode(cpu_encoded)))


@needs_gpu
def test_cuda_bytes_go_to_pinned_host_buffers_and_back():
    staging = staging_for("cuda")
    assert isinstance(staging, CopyStaging) and staging is staging_for(torch.device("cuda", 0))
    raw = torch.randint(0, 256, (10_000,), dtype=torch.uint8, device="cuda")
    host = staging.to_host(raw)
    assert bytes(host) == raw.cpu().numpy().tobytes()
    back, tail = staging.to_device([host, b"\x07" * 3])
    assert back.device.type == "cuda" and torch.equal(back, raw)
    assert tail.tolist() == [7, 7, 7]
    assert isinstance(host, memoryview)  # the pinned buffer itself, not a second copy


@needs_gpu
def test_cuda_error_feedback_residual_stays_on_the_gpu():
    feedback = ErrorFeedback(parse_codec("int4"))
    feedback.encode(torch.linspace(-1, 1, 300, device="cuda"))
    assert feedback.residual is not None and feedback.residual.device.type == "cuda"


@needs_gpu
@pytest.mark.parametrize("codec", ["none", "int8", "int2+zstd"])
def test_a_gpu_site_and_cpu_sites_end_bitwise_identical(codec):
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(50_003, generator=generator) for _ in range(3)]
    on_devices = [inputs[0].cuda(), inputs[1], inputs[2]]
    mixed = _exchange([None, None, None], on_devices, codec, "direct")
    for r, outs in enumerate(mixed):
        assert outs[0].device.type == "cuda"
        for out in outs:
            assert torch.equal(_bits(out), _bits(outs[0])), f"round {r}: sites disagree"
