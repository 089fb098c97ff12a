"""Which Host names an API server serves (serve/http_guards.py allowed_hosts), per bind: a
loopback bind only the loopback names and --allowed-hosts (DNS rebinding), a wider bind any
name unless --allowed-hosts lists them. Real servers: bad_input/test_http_guards.py and
test_http_limits.py."""

import pytest

from parashift.serve.http_guards import allowed_hosts, host_name
from parashift.serve.limits import ServeLimits

LOOPBACK = {"localhost", "127.0.0.1", "[::1]", "::1"}


@pytest.mark.parametrize(("host", "name"), [
    ("LocalHost:8000", "localhost"), ("127.0.0.1", "127.0.0.1"), ("[::1]:80", "[::1]"),
    ("[::1]", "[::1]"), ("rebind.example:1234", "rebind.example"), ("a.b:x", "a.b:x")])
def test_host_name_drops_the_port_and_case(host, name):
    assert host_name(host) == name


@pytest.mark.parametrize(("bind", "extra", "served"), [
    ("127.0.0.1", (), LOOPBACK),
    ("localhost", (), LOOPBACK),
    ("::1", (), LOOPBACK),
    ("127.0.0.1", ("Rebind.example:8000",), LOOPBACK | {"rebind.example"}),
    ("0.0.0.0", (), None),
    ("::", (), None),
    ("0.0.0.0", ("api.example",), LOOPBACK | {"api.example"}),
    ("10.1.2.3", ("api.example",), LOOPBACK | {"api.example", "10.1.2.3"}),
])
def test_the_names_served_per_bind(bind, extra, served):
    assert allowed_hosts(ServeLimits(bind_host=bind, allowed_hosts=extra)) == served
