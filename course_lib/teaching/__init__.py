"""The teaching machinery: checks and their diagnosis, the chapters' exercises, concept
questions, widgets, grading and the notebook generator.
"""
