"""The control-plane token the tests' engines are launched with (vime.rollout.auth)."""

from vime.rollout.auth import auth_headers

TOKEN = "vime-test-engine-token"
HEADERS = auth_headers(TOKEN)
