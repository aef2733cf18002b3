"""MLA weight release backport (placeholder while being written)."""

from npu_shim import config, patching


class MlaWeightRelease(patching.Patch):
    name = "mla_weight_release"
    title = "Free MLA weights the mlaprolog path no longer reads (PD disaggregation)"
    upstream_pr = "sgl-project/sglang#38807"
    upstream_release = "0.5.20"
    backport_range = "0.5.9 - 0.5.19"
    remove_when = "every supported image runs sglang >= 0.5.20"
    switch = config.MLA_WEIGHT_RELEASE
    reads = (config.MLA_RELEASE_FORCE,)
    modules = ()

    def probe(self, view):
        return None

    def targets(self, view):
        return []


PATCH = MlaWeightRelease()
