"""The platform: the machine and the environment the course runs in (runtime, hardware,
versions, Colab, the JupyterLab launcher, the environment report, the stand-in driver).
"""
