"""sparkforge: build, deploy and benchmark DeepSeek-V4.1-Flash on DGX Spark rings."""
