"""Fallback stand-in for @rules_java//java:repositories.bzl: nothing to fetch offline."""

def rules_java_dependencies():
    pass

def rules_java_toolchains(name = "toolchains"):
    pass
