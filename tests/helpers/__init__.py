"""What several test modules share: tiny models, decoding helpers, CLI runners and fixtures. No test module imports
another; they import from here."""
