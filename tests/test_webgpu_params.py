"""The webgpu kernels' named parameter structs: the Python mirror packs keyword arguments under WGSL's uniform
layout (checked against a NumPy structured dtype) and refuses fields the shader does not declare. Needs no GPU."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from leafpy.backends.webgpu import params
from leafpy.errors import BackendError

WGSL = Path(params.__file__).parent


def _layout(fields: list[tuple[str, str]], size: int) -> np.dtype:
    kinds = {"u32": "<u4", "i32": "<i4", "f32": "<f4"}
    return np.dtype({"names": [f for f, _ in fields], "formats": [kinds[k] for _, k in fields],
                     "offsets": [4 * i for i in range(len(fields))], "itemsize": size})


@pytest.mark.parametrize("count", [1, 3, 4, 5, 9])
def test_packed_bytes_follow_the_uniform_layout(count):
    kinds = ["u32", "f32", "i32"]
    fields = [(f"x{i}", kinds[i % 3]) for i in range(count)]
    source = "// a comment: not a field\nstruct P {\n" + "".join(f"    {f}: {k},  // {f}\n" for f, k in fields) + "}\n"
    p = params.parse_structs(source, "test")["P"]
    values = {f: (i + 1 if k == "u32" else (-(i + 1) if k == "i32" else 0.25 * (i + 1))) for i, (f, k) in
              enumerate(fields)}
    given = dict(list(values.items())[1:])  # the first field left out: it is 0
    size = 16 * -(-4 * count // 16)
    expected = np.zeros(1, _layout(fields, size))
    for f, v in given.items():
        expected[f] = v
    assert p.size == size
    assert p(**given) == expected.tobytes()


def test_a_u32_field_takes_a_negative_value_modulo_2_to_the_32():
    p = params.parse_structs("struct Q { a: u32 }", "test")["Q"]
    assert p(a=-1) == np.array([0xFFFFFFFF, 0, 0, 0], "<u4").tobytes()


def test_an_unknown_field_names_the_struct_and_its_fields():
    with pytest.raises(BackendError, match=r"ElementwiseParams \(elementwise.wgsl\) has no field alhpa; its fields: "
                                           r"count, base, .*alpha"):
        params.ElementwiseParams(count=1, alhpa=2.0)


def test_a_non_scalar_field_is_refused():
    with pytest.raises(BackendError, match=r"struct R in test.wgsl: .* got v: vec4"):
        params.parse_structs("struct R { n: u32, v: vec4<f32> }", "test")


def test_every_shader_binds_a_struct_that_has_a_mirror():
    mirrors = {v.name: v for v in vars(params).values() if isinstance(v, params.ParamStruct)}
    bound = {}
    for path in WGSL.glob("*.wgsl"):
        for name in re.findall(r"var<uniform>\s+p\s*:\s*(\w+)\s*;", path.read_text()):
            bound[name] = path.stem
    assert len(bound) >= 10
    assert {name: mirrors[name].module for name in bound if name in mirrors} == bound


def test_each_mirror_is_the_struct_its_shader_binds():
    from leafpy.backends.webgpu.sources import module_source

    mirrors = [v for v in vars(params).values() if isinstance(v, params.ParamStruct)]
    spare = {"elementwise": "act", "update": "hp"}  # a rule's parameters: as many fields as the most any rule takes
    for m in mirrors:
        source = module_source(m.module)  # with the code generated for it (the update rules' entry points)
        assert re.search(rf"var<uniform>\s+p\s*:\s*{m.name}\s*;", source), m
        for field in m.fields:  # every field is read somewhere (a stale one would hint at drift)
            assert re.search(rf"\bp\.{field}\b", source) or field.startswith(spare.get(m.module, "-")), \
                (m.name, field)


def test_every_activation_parameter_has_a_field():
    from leafpy.backends import pointwise

    slots = [f for f in params.ElementwiseParams.fields if re.fullmatch(r"act\d+", f)]
    assert slots == [f"act{i}" for i in range(len(slots))]
    most = max(len(line.params) for line in pointwise.TABLE.values())
    assert most <= len(slots), f"add act{len(slots)}.. to ElementwiseParams in elementwise.wgsl"


def test_every_update_rule_parameter_has_a_field():
    from leafpy.backends import updates

    slots = [f for f in params.UpdateParams.fields if re.fullmatch(r"hp\d+", f)]
    assert tuple(slots) == updates.WGSL_PARAMS, "UpdateParams in update.wgsl and updates.WGSL_PARAMS disagree"
    assert max(len(rule.params) for rule in updates.TABLE.values()) <= updates.MAX_PARAMS
