"""local_repository with a fallback, for the offline stand-ins of //:WORKSPACE.

local_repository_or_fallback(name, paths, fallback) mirrors the first
directory of `paths` that exists (absolute paths, e.g. what a distribution
package installs), else `fallback` (a directory relative to the workspace
root). Unlike a plain local_repository, a missing system directory is not an
error: the repository then comes from the project's own stand-in.
"""

def _local_repository_or_fallback_impl(rctx):
    chosen = None
    for candidate in rctx.attr.paths:
        path = rctx.path(candidate)
        if path.exists and path.get_child("WORKSPACE").exists:
            chosen = path
            break
    if chosen == None:
        chosen = rctx.path("%s/%s" % (rctx.path(Label("//:WORKSPACE")).dirname, rctx.attr.fallback))
        if not chosen.exists:
            fail("%s: none of %s exists, nor the fallback %s" % (rctx.name, rctx.attr.paths, chosen))
    for child in chosen.readdir():
        rctx.symlink(child, child.basename)

local_repository_or_fallback = repository_rule(
    implementation = _local_repository_or_fallback_impl,
    attrs = {
        "paths": attr.string_list(doc = "Absolute directories to try, in order."),
        "fallback": attr.string(mandatory = True, doc = "Directory relative to the workspace root."),
    },
    local = True,
)
