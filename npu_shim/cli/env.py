"""``python -m npu_shim env``: every variable the shim reads, with its kind, default and doc
(``core.loading.all_variables``: the shim's own, then each patch's)."""

import sys


def env_rows():
    from npu_shim.core.loading import all_variables

    return [{"name": var.name, "kind": var.kind, "default": var.default, "doc": var.doc,
             "aliases": list(var.aliases)} for var in all_variables()]


def print_env(as_json=False):
    rows = env_rows()
    if as_json:
        from npu_shim.reporting.terminal import print_json

        print_json(rows)
        return
    for row in rows:
        also = " (also read as %s)" % ", ".join(row["aliases"]) if row["aliases"] else ""
        sys.stdout.write("%s  [%s, default %r]%s\n    %s\n" % (row["name"], row["kind"], row["default"],
                                                             also, row["doc"]))
