"""A fixture that counts the row-invariance probe's runs."""

import pytest

import eagle3_hf.generation.verify_choice as verify_choice


@pytest.fixture
def probes(monkeypatch):
    """Counts the probe runs."""
    calls = []
    real = verify_choice.probe_row_exactness

    def counted(model, *args, **kwargs):
        calls.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(verify_choice, "probe_row_exactness", counted)
    return calls
