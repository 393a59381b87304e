"""The lab's checks share the product suite's fixtures (tests/conftest.py)."""

from tests.conftest import smollm_tokenizer  # noqa: F401 - a fixture, found by name
