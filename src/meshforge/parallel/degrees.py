"""The degrees: one -1 inferred from the world size, and each rank's coordinate on the mesh."""

from __future__ import annotations

from meshforge.config.layout import DIMS, ISLAND, Layout
from meshforge.errors import ConfigError
from meshforge.parallel.rule_types import product


def resolve_degrees(layout: Layout, world_size: int) -> Layout:
    """The layout with one -1 degree inferred; refuses products that do not match the world size
    (under DiLoCo the degrees are one island's: world_size / islands ranks)."""
    islands = layout.islands
    if islands < 1 or world_size % islands:
        raise ConfigError(
            f"diloco.islands = {islands} must be >= 1 and divide the world size {world_size} (every island runs "
            f"the same inner layout); use a divisor of {world_size} or start a multiple of {max(islands, 1)} ranks"
        )
    world_size //= islands
    mesh = layout.degrees()
    for k, v in {**mesh, "ep": layout.ep}.items():
        if v == 0 or v < -1 or (k == "ep" and v < 1):
            raise ConfigError(f"parallel.{k} = {v} must be >= 1" + ("" if k == "ep" else " (or -1 to infer it)"))
    free = [k for k, v in mesh.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"only one parallel degree may be -1, got {', '.join('parallel.' + k for k in free)}")
    known = product(v for v in mesh.values() if v > 0)
    shown = " x ".join(f"{k}={v}" for k, v in mesh.items())
    if free:
        if world_size % known:
            raise ConfigError(
                f"parallel degrees {shown}: world size {world_size} is not divisible by the fixed degrees' "
                f"product {known}; start a multiple of {known} ranks (--nproc {known}, or as many under torchrun) "
                "or change the degrees"
            )
        mesh[free[0]] = world_size // known
    elif known != world_size:
        rest = known // mesh["dp_shard"]
        hint = (
            f"set parallel.dp_shard = {world_size // rest}"
            if world_size % rest == 0
            else ("make their product equal the world size")
        )
        raise ConfigError(
            f"parallel degrees {shown} multiply to {known}, not the world size {world_size}; "
            f"set parallel.dp_shard = -1 to infer it, or {hint}"
        )
    return layout.replace(**mesh)


def rank_layout(degrees: dict[str, int]) -> list[dict[str, int]]:
    """Each global rank's coordinate on every mesh dimension (row-major, tp fastest; the
    island dimension first when ``degrees`` has one)."""
    names = [d for d in (ISLAND, *DIMS) if d in degrees]
    sizes = [degrees[d] for d in names]
    out = []
    for r in range(product(sizes)):
        coord, rest = {}, r
        for d, s in reversed(list(zip(names, sizes, strict=True))):
            coord[d] = rest % s
            rest //= s
        out.append({"rank": r, **{d: coord[d] for d in names}})
    return out
