"""Every graph test compiles the toy model with a backend of its own; dynamo keeps compiled code
per code object and refuses a ninth backend, so each test starts from a clean dynamo cache."""

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
