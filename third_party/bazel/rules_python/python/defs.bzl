"""Offline stand-in for @rules_python//python:defs.bzl: Bazel's native Python rules.

Bazel 4.2.3 has no rules_python of its own; Bazel 7 still has the native rules
(deprecated). Loading them through this file keeps BUILD files in the form the
real rules_python expects, so switching to it later is a WORKSPACE change.
"""

load("@bazel_tools//tools/python:toolchain.bzl", _py_runtime_pair = "py_runtime_pair")

def py_binary(**attrs):
    native.py_binary(**attrs)

def py_library(**attrs):
    native.py_library(**attrs)

def py_runtime(**attrs):
    native.py_runtime(**attrs)

def py_test(**attrs):
    native.py_test(**attrs)

py_runtime_pair = _py_runtime_pair
