"""The control-plane token the tests' engines are launched with (vime.engines.auth)."""

from vime.engines.auth import auth_headers

TOKEN = "vime-test-engine-token"
HEADERS = auth_headers(TOKEN)
