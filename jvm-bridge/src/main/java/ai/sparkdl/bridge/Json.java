package ai.sparkdl.bridge;

import java.util.Map;

/** Just enough JSON writing for flat event records (no dependency beyond the JDK). */
final class Json {
    private Json() {}

    static String quote(String value) {
        if (value == null) {
            return "null";
        }
        StringBuilder out = new StringBuilder(value.length() + 2).append('"');
        for (int i = 0; i < value.length(); i++) {
            char c = value.charAt(i);
            switch (c) {
                case '"': out.append("\\\""); break;
                case '\\': out.append("\\\\"); break;
                case '\n': out.append("\\n"); break;
                case '\r': out.append("\\r"); break;
                case '\t': out.append("\\t"); break;
                default:
                    if (c < 0x20) {
                        out.append(String.format("\\u%04x", (int) c));
                    } else {
                        out.append(c);
                    }
            }
        }
        return out.append('"').toString();
    }

    /** Values may be String, Number, Boolean, null or an already-encoded JsonRaw. */
    static String object(Map<String, Object> fields) {
        StringBuilder out = new StringBuilder("{");
        boolean first = true;
        for (Map.Entry<String, Object> field : fields.entrySet()) {
            if (!first) {
                out.append(", ");
            }
            first = false;
            out.append(quote(field.getKey())).append(": ").append(value(field.getValue()));
        }
        return out.append('}').toString();
    }

    static String value(Object value) {
        if (value == null) {
            return "null";
        }
        if (value instanceof Raw) {
            return ((Raw) value).json;
        }
        if (value instanceof Number || value instanceof Boolean) {
            return value.toString();
        }
        return quote(value.toString());
    }

    /** A value that is already JSON (an array or object). */
    static final class Raw {
        final String json;

        Raw(String json) {
            this.json = json;
        }
    }
}
