"""Generated gRPC stubs of the contracts in proto/ (``make proto``); never edited by hand."""
