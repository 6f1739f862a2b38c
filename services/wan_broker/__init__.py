"""The Atlas slot arbiter and WAN emulator."""
