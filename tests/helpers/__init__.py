"""What tests share, no tests of its own: stand-in vLLM servers, fixtures, input builders, brute-force references."""
