"""Standing questions by meaning: matching newly indexed claims against agents\x27 watches and pushing notices."""
