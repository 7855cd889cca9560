from typing import Any

from django import forms

from apps.quality.cases import MAX_BYTES

# A refused file comes back in the text box to be fixed there, up to this size; a larger one is
# chosen again.
KEPT_CHARS = 200_000


class SetImportForm(forms.Form):
    name = forms.SlugField(
        max_length=60,
        label="Set name",
        help_text="Letters, digits, - and _; an existing name gets its next version.",
    )
    file = forms.FileField(
        required=False,
        label="JSON Lines file",
        help_text='One case a line: {"name": ..., "inputs": {...}, "expect": {...}}.',
    )
    text = forms.CharField(
        required=False,
        label="or the cases themselves",
        widget=forms.Textarea(attrs={"rows": 8, "spellcheck": "false", "class": "code"}),
        strip=False,
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        upload = data.get("file")
        if upload is not None and data.get("text", "").strip():
            raise forms.ValidationError("choose a file or paste cases, not both")
        if upload is not None:
            if upload.size > MAX_BYTES:
                raise forms.ValidationError(f"the file is larger than {MAX_BYTES // 2**20} MiB")
            data["source"] = upload.name  # read a line at a time by the import
        elif not data.get("text", "").strip():
            raise forms.ValidationError("choose a JSON Lines file, or paste its cases")
        else:
            data["source"] = ""
        return data


class RunForm(forms.Form):
    version = forms.TypedChoiceField(coerce=int, label="Version")
    baseline_version = forms.TypedChoiceField(
        coerce=int,
        empty_value=None,
        required=False,
        label="Baseline version",
        help_text="Asked the same cases, for its score and for agrees rules.",
    )

    def __init__(self, *args: Any, versions: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choices = [(v, f"v{v}") for v in versions]
        for name, given in (("version", choices), ("baseline_version", [("", "none"), *choices])):
            field = self.fields[name]
            assert isinstance(field, forms.ChoiceField)
            field.choices = given

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("version") and data.get("version") == data.get("baseline_version"):
            self.add_error("baseline_version", "a baseline is another version")
        return data
