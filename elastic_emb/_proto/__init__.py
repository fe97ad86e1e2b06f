"""Generated from protos/ by protos/generate.sh; do not edit."""
