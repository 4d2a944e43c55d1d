"""Minimal offline rules_cc for Bazel 4: the native C++ rules under their rules_cc names.

Debian's bazel-bootstrap (4.2) asks for rules_cc from the network, and Debian's
bazel-rules-cc is too new for it; this stands in for both.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)
