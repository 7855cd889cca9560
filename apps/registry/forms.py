from django import forms

from apps.registry.codec import MAX_CONFIG_CHARS


class VersionForm(forms.Form):
    pbtxt = forms.CharField(
        label="config.pbtxt",
        max_length=MAX_CONFIG_CHARS,
        widget=forms.Textarea(attrs={"rows": 28, "spellcheck": "false"}),
    )
    artifact = forms.CharField(
        max_length=500, required=False, help_text="s3://, gs:// or a repository path"
    )
    notes = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 3}))


class ImportForm(forms.Form):
    archive = forms.FileField(help_text="a zip of a Triton model repository")
    dry_run = forms.BooleanField(required=False, label="Validate only")
